"""provider.hosts entries read the way `ssh` reads them: through the user's ~/.ssh/config.

``load(path) -> (paramiko.SSHConfig, shown)``: the config (``provider.ssh_config`` or
~/.ssh/config; none there is an empty config) and how to name it in messages.
``resolve(spec, config, field, shown) -> Resolved``: user, address, port and the SSHRoute for
one entry. ``user@host:port`` parts written in the entry win over the config; then the Host
block's User, Port, HostName, IdentityFile (+ IdentitiesOnly), ProxyJump (one or more hops,
each looked up in the same config, its own ProxyJump first, as ssh does), ConnectTimeout and
ServerAliveInterval. A host the laptop connects to itself (no ProxyJump) whose name (or
HostName) this machine cannot resolve is one ConfigError naming the field: a typo that only
matches a wildcard block (`Host gpu-*`) is caught too.

paramiko.SSHConfig does the parsing and matching (Match, wildcards, tokens, ~). fabric's
Connection reads ProxyJump too, but it visits multi-hop lists last hop first (OpenSSH goes
first hop first), so the hops are ordered here and fabric gets them as explicit gateways.
"""

from __future__ import annotations

import fnmatch
import getpass
import ipaddress
import socket
from dataclasses import dataclass
from pathlib import Path

import paramiko

from provision.core.errors import ConfigError
from provision.core.ssh_route import JumpHop, SSHRoute

DEFAULT_CONFIG = "~/.ssh/config"
MAX_HOPS = 8  # a ProxyJump chain longer than this is a loop in the config


@dataclass(frozen=True)
class Resolved:
    user: str
    address: str
    port: int
    route: SSHRoute | None  # None: plain user@host:port, nothing else from the config

    @property
    def where(self) -> str:
        via = f" via {self.route.jumps[-1].where}" if self.route and self.route.jumps else ""
        return f"{self.user}@{self.address}:{self.port}{via}"


def load(path: str | None) -> tuple[paramiko.SSHConfig, str]:
    shown = path or DEFAULT_CONFIG
    file = Path(shown).expanduser()
    if not file.is_file():
        if path:
            raise ConfigError(
                f"provider.ssh_config: {file} does not exist",
                "fix the path, or remove provider.ssh_config to read ~/.ssh/config",
            )
        return paramiko.SSHConfig(), shown
    try:
        return paramiko.SSHConfig.from_path(str(file)), shown
    except (OSError, UnicodeDecodeError, paramiko.ssh_exception.ConfigParseError) as exc:
        raise ConfigError(
            f"provider.ssh_config: cannot read {file}: {exc}", "fix the file (`ssh -G HOST -F FILE`)"
        ) from None


def split_spec(spec: str) -> tuple[str | None, str, int | None]:
    """`[user@]host[:port]` (and ssh://...) -> (user, host, port)."""
    from provision.core.provider_config import HOST_RE

    text = spec.strip().removeprefix("ssh://")
    match = HOST_RE.match(text)
    if not match:
        raise ConfigError(
            f"{spec!r} is not host, alias, host:port or user@host:port", "e.g. gpu-box or ubuntu@203.0.113.7:2222"
        )
    return match["user"], match["host"], int(match["port"]) if match["port"] else None


def is_alias(config: paramiko.SSHConfig, name: str) -> bool:
    """True when a Host block other than `Host *` names it."""
    return any(p != "*" and not p.startswith("!") and fnmatch.fnmatchcase(name, p) for p in config.get_hostnames())


def resolvable(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        pass
    try:
        socket.getaddrinfo(name, None)
        return True
    except (OSError, UnicodeError):
        return False


def resolve(
    spec: str, config: paramiko.SSHConfig, field: str, shown: str = DEFAULT_CONFIG, depth: int = 0, local: bool = True
) -> Resolved:
    """`local`: the laptop looks the name up itself (not a hop that an earlier hop reaches)."""
    user, name, port = split_spec(spec)
    opts = config.lookup(name)
    alias = is_alias(config, name)
    address = opts.get("hostname", name)
    jumps = _jumps(opts.get("proxyjump", "none"), config, field, shown, depth, own=name)
    if local and not jumps and not resolvable(address):  # what the laptop itself must connect to
        named = f"{name!r} (HostName {address})" if address != name else repr(name)
        raise ConfigError(
            f"{field}: {named} is no Host alias in {shown} and no host name this machine resolves",
            f"add a `Host {name}` block (HostName, User, ProxyJump ...) to {shown}, point provider.ssh_config "
            "at the file that has it, or fix the name",
        )
    if opts.get("proxycommand", "none").lower() != "none":
        raise ConfigError(
            f"{field}: {name!r} uses ProxyCommand in {shown}, which gpuctl does not run",
            "reach it with ProxyJump (`ProxyJump bastion`) instead",
        )
    # ssh logs in as your own user name when the config names none; plain user@host entries keep
    # gpuctl's default (root), as before aliases existed
    user = user or opts.get("user") or (getpass.getuser() if alias else "root")
    port = port or int(opts.get("port", 22))
    keys = list(opts.get("identityfile", []))
    only = opts.get("identitiesonly", "no").lower() == "yes"
    timeout = float(opts["connecttimeout"]) if "connecttimeout" in opts else None
    alive = int(opts["serveraliveinterval"]) if "serveraliveinterval" in opts else None
    if not (alias or jumps or keys or timeout or alive is not None):
        return Resolved(user, address, port, None)
    route = SSHRoute(
        alias=name if alias else None,
        identity_files=keys,
        identities_only=only,
        jumps=jumps,
        connect_timeout=timeout,
        keepalive_s=alive,
    )
    return Resolved(user, address, port, route)


def _jumps(value: str, config: paramiko.SSHConfig, field: str, shown: str, depth: int, own: str) -> list[JumpHop]:
    # a hop naming the host itself (`Host *` with ProxyJump reaches the bastion too): no hop
    specs = [h.strip() for h in value.split(",") if h.strip() and split_spec(h)[1] != own]
    if value.lower() == "none" or not specs:
        return []
    if depth >= MAX_HOPS:
        raise ConfigError(
            f"{field}: ProxyJump in {shown} goes more than {MAX_HOPS} hops deep (a loop?)", f"fix ProxyJump in {shown}"
        )
    hops: list[JumpHop] = []
    for i, spec in enumerate(specs):
        hop = resolve(spec, config, f"{field} (ProxyJump {spec})", shown, depth + 1, local=i == 0)
        route = hop.route or SSHRoute()
        hops += route.jumps  # the jump host's own ProxyJump comes first, as ssh does it
        hops.append(
            JumpHop(
                address=hop.address,
                port=hop.port,
                user=hop.user,
                identity_files=route.identity_files,
                identities_only=route.identities_only,
            )
        )
    return hops
