"""One module per provider behind one small interface (see base.py)."""

from __future__ import annotations

from importlib import import_module

from provision.providers.base import ProviderBackend

_MODULES = {"local": "local", "ssh": "ssh", "vast": "vast", "runpod": "runpod", "aws": "aws"}


def backend(kind: str) -> ProviderBackend:
    """The provider module for a kind, imported only when used (keeps the CLI fast)."""
    module = import_module(f"provision.providers.{_MODULES[kind]}")
    return module.BACKEND
