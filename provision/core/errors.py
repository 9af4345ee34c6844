"""Errors the CLI turns into one line: what went wrong, then how to fix it."""

from __future__ import annotations


class GpuctlError(Exception):
    """A failure the user can act on. `fix` names the next thing to try."""

    exit_code = 1

    def __init__(self, message: str, fix: str | None = None):
        super().__init__(message)
        self.message = message
        self.fix = fix

    def one_line(self) -> str:
        text = " ".join(self.message.split())
        return f"{text} (fix: {self.fix})" if self.fix else text


class ConfigError(GpuctlError):
    exit_code = 2


class NotFoundError(GpuctlError):
    exit_code = 3


class RemoteError(GpuctlError):
    exit_code = 4


class StateError(GpuctlError):
    """A record in gpuctl's state dir is damaged (truncated, edited, from another version)."""

    exit_code = 6


class ProviderError(GpuctlError):
    """A cloud provider's API refused a request or kept failing."""

    exit_code = 5


class AuthError(ProviderError):
    """The provider rejected (or we lack) the API key. The message never contains the key."""


class NoOfferError(ProviderError):
    """No rentable machine matches the configured filters."""


class ClusterBusy(GpuctlError):
    """Another gpuctl process is bringing the same cluster up or down."""

    exit_code = 7
