"""How the laptop reaches an SSH node when ~/.ssh/config says more than user@host:port.

Resolved once, at `gpuctl up`, from the user's OpenSSH client config (provision/transport/ssh/
aliases.py) and recorded with the node, so every later command (train, logs, cancel, down, ssh)
takes the same route without reading the config again.
"""

from __future__ import annotations

from pydantic import BaseModel, Field


class JumpHop(BaseModel):
    """One ProxyJump host, as the previous hop (or the laptop, for the first) reaches it."""

    address: str
    port: int = Field(default=22, ge=1, le=65535)
    user: str
    identity_files: list[str] = Field(default_factory=list, description="IdentityFile lines; empty: agent/default keys")
    identities_only: bool = False

    @property
    def where(self) -> str:
        return f"{self.user}@{self.address}:{self.port}"


class SSHRoute(BaseModel):
    """What an ssh_config Host block adds to address, port and user."""

    alias: str | None = Field(default=None, description="the provider.hosts entry it came from, when an alias")
    identity_files: list[str] = Field(default_factory=list, description="IdentityFile lines; empty: agent/default keys")
    identities_only: bool = False
    jumps: list[JumpHop] = Field(default_factory=list, description="ProxyJump hops, the laptop's side first")
    connect_timeout: float | None = Field(default=None, gt=0, description="ConnectTimeout")
    keepalive_s: int | None = Field(default=None, ge=0, description="ServerAliveInterval")
