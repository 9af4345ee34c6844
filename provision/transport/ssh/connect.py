"""Opening SSH connections: open_client, wait_for_ssh, and ConnectError for every failure.

``open_connection(address, port, user, identity_file, *, route, timeout, pin_new) -> fabric.Connection``
    A new authenticated fabric Connection (its paramiko client: ``.client``), reached through
    the route's ProxyJump hops (fabric gateways), every hop's host key checked against gpuctl's
    known_hosts (hostkeys.PinPolicy). Every failure is a ConnectError with one line naming the
    hop and the next thing to try; its ``transient`` says whether retrying can help (refused,
    timeout, no banner yet; never for a jump host, which does not boot with the node).
    ``close_chain(conn)`` closes it and its gateways.

``wait_for_ssh(address, port, deadline, *, say=None, probe_timeout=5.0) -> str``
    Poll until an SSH server answers on address:port with its banner (``SSH-2.0-...``, not
    merely an open TCP port: a cloud node's port forwarder accepts long before sshd runs).
    ``deadline`` is a ``time.monotonic()`` instant. Returns the banner line; raises
    ConnectError (transient=True) naming the last problem when the deadline passes.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import paramiko

from provision.core import interrupt
from provision.core.errors import RemoteError
from provision.core.ssh_route import SSHRoute
from provision.transport.ssh.channel import DEFAULT_CONNECT_TIMEOUT
from provision.transport.ssh.hostkeys import KnownHostsMismatch, PinPolicy, UnknownHostKey, known_hosts_path

if TYPE_CHECKING:
    from fabric import Connection

# paramiko logs a dropped connection ("Socket exception: Connection reset") from its reader
# thread; gpuctl reports it as one RemoteError line instead. GPUCTL_DEBUG=1 shows the logs.
if os.environ.get("GPUCTL_DEBUG", "") in ("", "0"):
    logging.getLogger("paramiko").setLevel(logging.CRITICAL + 1)

KEEPALIVE_S = 15


class ConnectError(RemoteError):
    """Could not open an SSH session. `transient`: a booting node can still become ready."""

    def __init__(self, message: str, fix: str | None = None, *, transient: bool = False):
        super().__init__(message, fix)
        self.transient = transient


class HostKeyRefused(ConnectError):
    """The host's key is not the one gpuctl (or the user's ~/.ssh/known_hosts) expects: waiting will not help."""


def endpoint(user: str, address: str, port: int) -> str:
    """How a connection is named in messages and node labels."""
    return f"{user}@{address}:{port}"


def _connect_error(
    exc: BaseException, user: str, address: str, port: int, timeout: float, identity_file: str | None
) -> ConnectError:
    """One line for each way a connection fails, with the next thing to try."""
    where = endpoint(user, address, port)
    if isinstance(exc, KnownHostsMismatch):
        return HostKeyRefused(
            f"{where}: host key {exc.key.get_name()} {exc.key.fingerprint} differs from the one your "
            f"{exc.path} has for {exc.hostname} ({exc.expected_key.fingerprint}); refusing to connect",
            f"if the machine was really reinstalled, `ssh-keygen -R '{exc.hostname}'`, then retry; else do not connect",
        )
    if isinstance(exc, paramiko.BadHostKeyException):
        return HostKeyRefused(
            f"{where}: host key CHANGED (now {exc.key.get_name()} {exc.key.fingerprint}, pinned "
            f"{exc.expected_key.fingerprint}); refusing to connect",
            f"if the machine was really reinstalled, run `gpuctl forget-host {address}:{port}`, then `gpuctl up`",
        )
    if isinstance(exc, UnknownHostKey):
        return HostKeyRefused(
            f"{where}: host key {exc.key.get_name()} {exc.key.fingerprint} is not pinned by gpuctl",
            "run `gpuctl up` to connect and pin it",
        )
    if isinstance(exc, paramiko.AuthenticationException):
        what = f"key {identity_file}" if identity_file else "your SSH agent/default keys"
        return ConnectError(
            f"{where}: authentication failed with {what}",
            "check provider.identity_file and that its public key is in the node's authorized_keys",
        )
    if isinstance(exc, paramiko.ssh_exception.NoValidConnectionsError):
        first = next(iter(exc.errors.values()), None)  # refused/unreachable on every address
        if isinstance(first, OSError):
            exc = first
    if isinstance(exc, socket.gaierror):
        return ConnectError(
            f"{where}: cannot resolve host {address!r} ({exc.strerror})",
            "check the host name in provider.hosts",
            transient=True,
        )
    if isinstance(exc, ConnectionRefusedError):
        return ConnectError(
            f"{where}: connection refused (no SSH server on port {port})",
            "check the port in provider.hosts and that sshd runs",
            transient=True,
        )
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return ConnectError(
            f"{where}: no answer within {timeout:g}s (host unreachable or down)",
            "check the address and your network; a booting node needs a minute",
            transient=True,
        )
    # paramiko: "Error reading SSH protocol banner", or "No existing session" when its
    # handshake wait (the same timeout) ran out first
    if isinstance(exc, paramiko.SSHException) and ("banner" in str(exc).lower() or "No existing session" in str(exc)):
        return ConnectError(
            f"{where}: no SSH banner within {timeout:g}s (not an SSH server, or it is overloaded)",
            "check the port in provider.hosts",
            transient=True,
        )
    if isinstance(exc, OSError) and exc.errno is not None:
        return ConnectError(f"{where}: {exc.strerror or exc}", "check the address and port", transient=True)
    return ConnectError(
        f"{where}: SSH connection failed: {exc or type(exc).__name__}",
        "retry; GPUCTL_DEBUG=1 shows the details",
        transient=True,
    )


def _fabric_config() -> object:
    """fabric settings for gpuctl's connections: no ssh_config of its own (aliases.py resolved
    the route at `up`; fabric would read ~/.ssh/config again and visit multi-hop ProxyJump
    lists in the other order) and a remote runner whose exec request cannot hang for good."""
    from fabric import Config

    from provision.transport.ssh.runner import BoundedRemote

    return Config(overrides={"load_ssh_configs": False, "runners": {"remote": BoundedRemote}})


def _connection(
    address: str,
    port: int,
    user: str,
    keys: list[str],
    *,
    agent: bool,
    timeout: float,
    pin_new: bool,
    gateway: object | None,
) -> Connection:
    """A fabric Connection (not yet open) whose paramiko client checks gpuctl's known_hosts."""
    from fabric import Connection

    conn = Connection(
        address,
        user=user,
        port=port,
        config=_fabric_config(),
        gateway=gateway or False,  # False: no gateway from fabric's own config
        connect_kwargs={
            "key_filename": [str(Path(k).expanduser()) for k in keys],
            "look_for_keys": not keys,
            "allow_agent": agent,
            "timeout": timeout,  # here, not connect_timeout=: fabric rounds that to whole seconds
            "banner_timeout": timeout,
            "auth_timeout": timeout,
            "channel_timeout": timeout,  # also bounds the next hop's direct-tcpip open through it
        },
    )
    path = known_hosts_path()
    if path.is_file():
        conn.client.load_system_host_keys(str(path))  # checked, never written back by paramiko
    conn.client.set_missing_host_key_policy(PinPolicy(pin_new))  # fabric's default trusts any key
    return conn


def _open(
    conn: Connection, where: tuple[str, str, int], timeout: float, keys: list[str], *, via: str | None, jump: bool
) -> None:
    """Open one hop (`jump`: a bastion; `via`: the jump host it is reached through); a failure
    is one ConnectError naming the hop."""
    user, address, port = where
    try:
        try:
            conn.open()
        except BaseException:
            # paramiko keeps a failed login's transport (its reader thread and socket) open: a node
            # whose sshd never lets the key in would hold one more of each per try, until its sshd
            # drops connections past MaxStartups. Every failed attempt closes what it opened.
            conn.client.close()
            raise
    except paramiko.ChannelException as exc:  # `via`'s answer to "forward me to address:port"
        prohibited = exc.code == 1
        what = (
            "refused to forward the connection (administratively prohibited)"
            if prohibited
            else f"cannot reach it ({exc.text})"
        )
        raise ConnectError(
            f"{'jump host ' if jump else ''}{endpoint(user, address, port)}: jump host {via} {what}",
            "allow TCP forwarding (AllowTcpForwarding yes) on the jump host"
            if prohibited
            else "check that the host runs sshd and that the jump host reaches its address and port",
            transient=not prohibited and not jump,
        ) from None
    except (paramiko.SSHException, OSError, EOFError) as exc:
        error = _connect_error(exc, user, address, port, timeout, keys[0] if keys else None)
        if jump:
            error.message = f"jump host {error.message}"
            error.transient = False  # a bastion is not booting with the node: waiting will not help
            if isinstance(exc, paramiko.AuthenticationException):
                error.fix = "give the jump host an IdentityFile in your ssh config, or `ssh-add` its key"
        raise error from None
    conn.transport.set_keepalive(KEEPALIVE_S)


def open_connection(
    address: str,
    port: int,
    user: str,
    identity_file: str | None,
    *,
    route: SSHRoute | None = None,
    timeout: float = DEFAULT_CONNECT_TIMEOUT,
    pin_new: bool = False,
) -> Connection:
    """An open fabric Connection to the node, through route.jumps (each an open Connection, the
    gateway of the next); every hop's host key checked against gpuctl's known_hosts."""
    route = route or SSHRoute()
    timeout = route.connect_timeout or timeout
    gateway: Connection | None = None
    try:
        for hop in route.jumps:
            conn = _connection(
                hop.address,
                hop.port,
                hop.user,
                hop.identity_files,
                agent=not (hop.identities_only and hop.identity_files),
                timeout=timeout,
                pin_new=pin_new,
                gateway=gateway,
            )
            via = gateway.user + "@" + gateway.host + f":{gateway.port}" if gateway else None
            gateway = conn
            _open(conn, (hop.user, hop.address, hop.port), timeout, hop.identity_files, via=via, jump=True)
        keys = [identity_file] if identity_file else route.identity_files
        agent = identity_file is None and not (route.identities_only and keys)
        conn = _connection(address, port, user, keys, agent=agent, timeout=timeout, pin_new=pin_new, gateway=gateway)
        via = route.jumps[-1].where if route.jumps else None
        _open(conn, (user, address, port), timeout, keys, via=via, jump=False)
    except BaseException:
        close_chain(gateway)
        raise
    if route.keepalive_s:
        for hop in chain(conn):
            hop.transport.set_keepalive(route.keepalive_s)
    return conn


def chain(conn: Connection | None) -> list[Connection]:
    """The connection and its gateways, the node first."""
    out = []
    while conn is not None and not isinstance(conn, (str, bool)):
        out.append(conn)
        conn = conn.gateway
    return out


def close_chain(conn: Connection | None) -> None:
    for hop in chain(conn):
        hop.close()


def wait_for_ssh(
    address: str, port: int, deadline: float, *, say: Callable[[str], None] | None = None, probe_timeout: float = 5.0
) -> str:
    """Wait until address:port answers with an SSH banner; see the module docstring."""
    delay, last = 0.5, "not tried"
    while time.monotonic() < deadline:
        interrupt.check()
        budget = max(0.1, min(probe_timeout, deadline - time.monotonic()))
        try:
            with socket.create_connection((address, port), timeout=budget) as sock:
                sock.settimeout(budget)
                banner = _read_banner(sock)
            if banner.startswith("SSH-"):
                return banner
            last = f"answered {banner[:40]!r}, not an SSH banner"
        except (OSError, EOFError) as exc:
            last = _connect_error(exc, "-", address, port, budget, None).message.split(": ", 1)[-1]
        if say:
            say(f"waiting for SSH on {address}:{port}: {last}")
        time.sleep(max(0.0, min(delay, deadline - time.monotonic())))
        delay = min(delay * 2, 10)
    raise ConnectError(
        f"{address}:{port}: no SSH server answered before the deadline ({last})",
        "check the node in the provider's console; `gpuctl down` removes it",
        transient=True,
    )


def _read_banner(sock: socket.socket) -> str:
    data = b""
    while b"\n" not in data and len(data) < 1024:
        chunk = sock.recv(256)
        if not chunk:
            if not data:
                raise EOFError("closed without a banner")
            break
        data += chunk
    # RFC 4253: the server may send other lines before the version line.
    for line in data.decode("latin-1").splitlines():
        if line.startswith("SSH-"):
            return line.strip()
    return data.decode("latin-1").strip()
