"""Opening SSH connections: open_client, wait_for_ssh, and ConnectError for every failure.

``open_client(address, port, user, identity_file, *, timeout, pin_new) -> SSHClient``
    A new authenticated paramiko client, its host key checked against gpuctl's known_hosts
    (hostkeys.PinPolicy). Every failure is a ConnectError with one line and the next thing
    to try; its ``transient`` says whether retrying can help (refused, timeout, no banner yet).

``answered_within(chan, request, seconds)``
    Send a channel request whose answer paramiko waits for without a timeout (exec_command,
    invoke_subsystem); the channel is closed after ``seconds``, which ends the wait (TimeoutError).

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
import threading
import time
from collections.abc import Callable
from pathlib import Path

import paramiko

from provision.core import interrupt
from provision.core.errors import RemoteError
from provision.transport.ssh.hostkeys import KnownHostsMismatch, PinPolicy, UnknownHostKey, known_hosts_path

# paramiko logs a dropped connection ("Socket exception: Connection reset") from its reader
# thread; gpuctl reports it as one RemoteError line instead. GPUCTL_DEBUG=1 shows the logs.
if os.environ.get("GPUCTL_DEBUG", "") in ("", "0"):
    logging.getLogger("paramiko").setLevel(logging.CRITICAL + 1)

DEFAULT_CONNECT_TIMEOUT = 15.0
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


def open_client(
    address: str,
    port: int,
    user: str,
    identity_file: str | None,
    *,
    timeout: float = DEFAULT_CONNECT_TIMEOUT,
    pin_new: bool = False,
) -> paramiko.SSHClient:
    """A new authenticated paramiko client; host key checked against gpuctl's known_hosts."""
    client = paramiko.SSHClient()
    path = known_hosts_path()
    if path.is_file():
        client.load_system_host_keys(str(path))  # checked, never written back by paramiko
    client.set_missing_host_key_policy(PinPolicy(pin_new))
    key_file = str(Path(identity_file).expanduser()) if identity_file else None
    try:
        client.connect(
            address,
            port=port,
            username=user,
            key_filename=key_file,
            look_for_keys=key_file is None,
            allow_agent=key_file is None,
            timeout=timeout,
            banner_timeout=timeout,
            auth_timeout=timeout,
            channel_timeout=timeout,
        )
    except (paramiko.SSHException, OSError, EOFError) as exc:
        client.close()
        raise _connect_error(exc, user, address, port, timeout, identity_file) from None
    transport = client.get_transport()
    transport.set_keepalive(KEEPALIVE_S)
    return client


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


def answered_within(chan: paramiko.Channel, request: Callable[[], object], seconds: float) -> None:
    """Send a channel request that waits for the server's answer with no timeout of its own
    (paramiko's exec_command, invoke_subsystem). A node that stalls there would hold gpuctl
    for good, so the channel is closed after `seconds`, which ends the wait: TimeoutError."""
    stalled = threading.Event()

    def give_up() -> None:
        stalled.set()
        try:
            chan.close()
        except (paramiko.SSHException, OSError, EOFError):
            pass  # the connection is gone too: paramiko wakes the wait itself then

    timer = threading.Timer(seconds, give_up)
    timer.daemon = True
    timer.start()
    try:
        request()
    except paramiko.SSHException:
        if stalled.is_set():
            raise TimeoutError from None
        raise
    finally:
        timer.cancel()
