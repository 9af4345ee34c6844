"""The one error boundary: every failure a command can meet becomes one line with a fix.

Library code raises GpuctlError where it knows what went wrong. What escapes from below
(storage, plan/report inputs, pydantic, filelock, paramiko, a file that is not UTF-8, the OS)
is mapped here, once, for every command: `guard_all(app)` wraps each registered callback.
GPUCTL_DEBUG=1 lets the original exception through with its traceback.

The mapping looks exception classes up in sys.modules instead of importing them: a library
that was never imported cannot have raised, and `gpuctl --help` stays fast.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any

import typer

from provision.core.errors import ConfigError, GpuctlError, NotFoundError, RemoteError


def debug() -> bool:
    return os.environ.get("GPUCTL_DEBUG", "") not in ("", "0")


def _loaded(module: str, name: str) -> type | None:
    """The class `module.name` if that module is imported, else None."""
    found = getattr(sys.modules.get(module), name, None)
    return found if isinstance(found, type) else None


def _is(exc: BaseException, module: str, name: str) -> bool:
    cls = _loaded(module, name)
    return cls is not None and isinstance(exc, cls)


def _storage_error(exc: BaseException) -> GpuctlError | None:
    backends = "trainer.objstore.backends"
    if _is(exc, backends, "InvalidTag"):
        return ConfigError(str(exc), "`gpuctl ckpt ls` lists the tags")
    if _is(exc, backends, "StorageNotFound"):
        return NotFoundError(f"storage: {exc}", "`gpuctl ckpt ls` lists what the store holds; check storage.url")
    if _is(exc, backends, "StorageAuthError"):
        return ConfigError(f"storage: {exc}", "check the storage credentials (AWS_PROFILE, storage.profile)")
    if _is(exc, backends, "StorageUnavailable"):
        return RemoteError(f"storage: {exc}", "check storage.endpoint_url and the network, then retry")
    if _is(exc, backends, "UnsafeManifest"):
        return GpuctlError(
            f"storage: {exc}",
            "do not use that checkpoint: gpuctl did not write it that way (every node holds the bucket's "
            "write key); delete its folder from the store and check who can write there",
        )
    if _is(exc, backends, "StorageError"):
        return GpuctlError(f"storage: {exc}", "check storage.url and its credentials, then retry")
    return None


def _ssh_error(exc: BaseException) -> GpuctlError | None:
    if _is(exc, "paramiko", "BadHostKeyException"):
        return RemoteError(
            f"SSH host key changed: {exc}",
            "if the machine was really reinstalled, `gpuctl forget-host HOST:PORT`; else do not connect",
        )
    if _is(exc, "paramiko", "SSHException"):
        return RemoteError(f"SSH: {exc}", "check the host, its key and provider.identity_file, then retry")
    return None


def _library_error(exc: BaseException) -> GpuctlError | None:
    if _is(exc, "provision.estimate.hardware", "PlanError"):
        return ConfigError(str(exc), "fix the flag or gpuctl.yaml value it names")
    if _is(exc, "provision.estimate.report", "ReportError"):
        return GpuctlError(str(exc), "let the run log a few steps, or name a run with metrics")
    if _is(exc, "filelock", "Timeout"):
        return GpuctlError(
            f"another gpuctl holds the state lock ({getattr(exc, 'lock_file', '?')})",
            "wait for it to finish, or remove the lock file if no gpuctl is running",
        )
    if _is(exc, "pydantic", "ValidationError"):
        first = exc.errors()[0]  # type: ignore[attr-defined]
        where = ".".join(str(p) for p in first["loc"]) or "(top level)"
        return GpuctlError(
            f"invalid record: {where}: {first['msg']}", "GPUCTL_DEBUG=1 shows which file; fix or remove it"
        )
    return None


def as_gpuctl_error(exc: BaseException) -> GpuctlError | None:
    """The one-line form of an exception, or None for a bug (which keeps its traceback)."""
    if isinstance(exc, GpuctlError):
        return exc
    for mapper in (_storage_error, _ssh_error, _library_error):
        mapped = mapper(exc)
        if mapped is not None:
            return mapped
    if isinstance(exc, UnicodeDecodeError):
        return ConfigError(f"a file is not UTF-8 text ({exc.reason} at byte {exc.start})", "save it as UTF-8")
    if isinstance(exc, OSError) and exc.strerror:
        where = f": {exc.filename}" if exc.filename else ""
        return GpuctlError(f"{exc.strerror}{where}", "check the path, its permissions and the free disk space")
    return None


def guard(func: Callable[..., Any]) -> Callable[..., Any]:
    """Run a command; a mapped failure prints `error: ... (fix: ...)` and exits with its code."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except Exception as exc:
            mapped = as_gpuctl_error(exc)
            if mapped is None or debug():
                raise
            typer.echo(f"error: {mapped.one_line()}", err=True)
            raise typer.Exit(mapped.exit_code) from None

    return wrapper


def guard_all(app: typer.Typer) -> None:
    """Wrap every command of app and of its sub-apps (merged or named) in `guard`."""
    for command in app.registered_commands:
        if command.callback is not None:
            command.callback = guard(command.callback)
    for group in app.registered_groups:
        if group.typer_instance is not None:
            guard_all(group.typer_instance)
