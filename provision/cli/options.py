"""What every command group shares: the common options, output to the user, config loading.

Only typer is imported at module level; the config models load when a command needs them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

if TYPE_CHECKING:
    from provision.core.config import GpuctlConfig

ConfigOpt = Annotated[Optional[Path], typer.Option("--config", "-c", help="gpuctl.yaml (default: ./gpuctl.yaml)")]
JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable output")]
YesOpt = Annotated[bool, typer.Option("--yes", "-y", help="do not ask for confirmation")]
RunArg = Annotated[Optional[str], typer.Argument(help="run id (default: the newest)")]
ClusterOpt = Annotated[Optional[str], typer.Option(help="cluster name (default: the config's)")]


def say(text: str) -> None:
    """Progress and messages go to stderr; stdout is for what scripts read. A terminal that is
    gone (SIGHUP: the window closed) drops the line instead of stopping the clean-up that says it."""
    try:
        typer.echo(text, err=True)
    except OSError:
        pass


def confirmer(assume_yes: bool) -> Callable[[str], bool]:
    """A yes/no question on the terminal, or always yes with --yes."""
    if assume_yes:
        return lambda _question: True
    return lambda question: typer.confirm(question, default=False, err=True)


def load(path: Optional[Path]) -> GpuctlConfig:
    from provision.core.config import load_config

    return load_config(path)


def load_if_present(path: Optional[Path]) -> GpuctlConfig | None:
    """The config, or None when no -c was given and the cwd has no gpuctl.yaml."""
    from provision.core.config import CONFIG_NAME

    if path is None and not (Path.cwd() / CONFIG_NAME).is_file():
        return None
    return load(path)


def cluster_name(path: Optional[Path], cluster: Optional[str]) -> str:
    return cluster or load(path).cluster_name
