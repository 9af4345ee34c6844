"""The gpuctl command line: one Typer app made of the command groups, behind one error boundary.

Each group module holds its commands; heavy modules (boto3, paramiko, jinja2, pydantic models)
are imported inside the commands so `gpuctl --help` stays fast. `gpuctl CMD` builds an app of
CMD's group alone (GROUPS): typer converts every registered command at each start, and the other
groups' modules need not load (~20 ms of every command; benchmarks/bench_cli.py).
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import typer

SETTINGS: dict[str, Any] = {
    "help": "Rent a few GPUs, train with DeepSpeed, sync checkpoints, tear down.",
    "no_args_is_help": True,
    "pretty_exceptions_enable": False,
    "add_completion": False,
    # Plain help: typer's rich help imports rich.markdown (markdown-it) and costs ~0.1 s of every
    # `--help` and usage error (issue 37); the command views still draw with rich.
    "rich_markup_mode": None,
}
# Group module -> (its name on the command line when it is a named group, the commands it holds).
# A command missing here still runs, through the whole app; tests/test_cli_groups.py keeps it true.
GROUPS: dict[str, tuple[str | None, tuple[str, ...]]] = {
    "cluster": (None, ("init", "up", "offers", "down", "sweep", "ssh", "forget-host", "run")),
    "jobs": (None, ("train", "render", "status", "logs", "cancel")),
    "plan": (None, ("plan",)),
    "report": (None, ("report",)),
    "doctor": (None, ("doctor",)),
    "image": ("image", ("image",)),
    "ckpt": ("ckpt", ("ckpt",)),
}
_built: dict[tuple[str, ...], typer.Typer] = {}


def build(modules: tuple[str, ...] = tuple(GROUPS)) -> typer.Typer:
    """The app of these group modules (default: all), each command behind the error boundary."""
    if modules not in _built:
        from provision.cli import boundary

        app = typer.Typer(**SETTINGS)
        for module in modules:
            group = importlib.import_module(f"provision.cli.{module}").app
            name = GROUPS[module][0]
            if name:
                app.add_typer(group, name=name)
            else:
                app.add_typer(group)
        boundary.guard_all(app)
        _built[modules] = app
    return _built[modules]


def app_for(argv: list[str]) -> typer.Typer:
    """The app of the group holding the command named first; the whole app for --help, no command
    or an unknown one (typer lists the commands, or says which is wrong)."""
    name = argv[0] if argv and not argv[0].startswith("-") else None
    module = next((m for m, (_, commands) in GROUPS.items() if name in commands), None)
    return build((module,)) if module else build()


def __getattr__(name: str) -> typer.Typer:
    """`from provision.cli.app import app`: the whole app, built on first use."""
    if name == "app":
        return build()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main() -> None:
    from provision.cli import fastpath
    from provision.core import interrupt

    fastpath.tune()  # before typer's first pydantic import
    interrupt.install()  # a Ctrl-C is recorded too, so one that a finalizer swallowed still stops gpuctl
    try:
        app_for(sys.argv[1:])()
    except KeyboardInterrupt:  # typer turns one into exit 130 itself; this is for what escapes it
        typer.echo("interrupted", err=True)
        sys.exit(130)
    except SystemExit as done:  # how typer ends every command, 0 included
        fastpath.leave(done.code)
        raise
    fastpath.leave(0)


if __name__ == "__main__":
    main()
