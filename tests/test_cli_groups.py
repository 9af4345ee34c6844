"""`gpuctl CMD` builds the app of CMD's group alone (provision/cli/app.py GROUPS): the table names
every command of the whole app, each under the module that holds it, so no command is lost or
built twice, and the narrow app answers as the whole one does."""

from __future__ import annotations

import pytest
import typer.main

from provision.cli import app as cli


def names(app: typer.Typer) -> set[str]:
    return set(getattr(typer.main.get_command(app), "commands", {}))


def test_the_table_names_every_command_once():
    listed = [name for _group, commands in cli.GROUPS.values() for name in commands]
    assert sorted(listed) == sorted(set(listed))
    assert set(listed) == names(cli.build())


@pytest.mark.parametrize("module", list(cli.GROUPS))
def test_each_group_holds_what_the_table_says(module):
    assert names(cli.build((module,))) == set(cli.GROUPS[module][1])


@pytest.mark.parametrize(
    ("argv", "module"),
    [(["status"], "jobs"), (["ckpt", "ls"], "ckpt"), (["forget-host", "x"], "cluster"), (["plan", "-c", "y"], "plan")],
)
def test_a_command_builds_its_group(argv, module):
    assert cli.app_for(argv) is cli.build((module,))


@pytest.mark.parametrize("argv", [[], ["--help"], ["--help", "status"], ["bogus"]])
def test_help_and_unknown_commands_get_the_whole_app(argv):
    assert cli.app_for(argv) is cli.build()
