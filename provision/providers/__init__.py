"""One module per provider behind one small interface (base.ProviderBackend)."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

from provision.core.errors import ConfigError

if TYPE_CHECKING:
    from provision.providers.base import ProviderBackend

MODULES = {"local": "local", "ssh": "ssh_hosts", "vast": "vast", "runpod": "runpod", "aws": "aws", "slurm": "slurm"}


def backend(kind: str) -> ProviderBackend:
    """The provider module for a kind, imported only when used (keeps the CLI fast)."""
    if kind not in MODULES:
        raise ConfigError(
            f"unknown provider {kind!r} (in a cluster record or the config)",
            f"use one of {', '.join(MODULES)}; `gpuctl down --cluster NAME` after fixing the record",
        )
    backend: ProviderBackend = import_module(f"provision.providers.{MODULES[kind]}").BACKEND
    return backend
