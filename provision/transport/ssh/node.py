"""SSH transport: SSHNode, a remote.Node over a fabric Connection; forget_host.

``SSHNode(address, port=22, user="root", identity_file=None, *, connect_timeout=15,
pin_new=False, label=None, route=None)``
    A remote.Node over SSH. Commands are argv lists joined with shlex.join, so user values
    arrive verbatim. One connection (fabric Connection; through ``route``'s ProxyJump hosts
    when it has any) per (user, address, port, key, route) per gpuctl process, opened on first
    use and reused by every SSHNode for that host; a broken one is dropped and the next call
    reconnects. ``pin_new=True`` (only `gpuctl up`, on first contact) records an unknown host
    key, the jump hosts' too, in gpuctl's known_hosts; otherwise an unknown key is refused, and
    a changed key is always refused (`gpuctl forget-host HOST` resets it). Every failure is a
    RemoteError with one line; connection failures are ConnectError (``transient``: retrying
    can help).

``forget_host(spec) -> int`` removes a host's pinned keys (``host``, ``host:port`` or
``user@host:port``), closes its pooled connections and returns how many lines went.
"""

from __future__ import annotations

import atexit
import codecs
import os
import posixpath
import select
import shlex
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import paramiko

from provision.core import interrupt, state
from provision.core.errors import RemoteError
from provision.core.ssh_route import SSHRoute
from provision.transport.ignore import walk_shipped
from provision.transport.remote import READ_BYTES, CommandResult, LineSink, Node, last_line_of, read_from, read_whole
from provision.transport.ssh.channel import DEFAULT_CONNECT_TIMEOUT, answered_within
from provision.transport.ssh.connect import close_chain, endpoint, open_connection
from provision.transport.ssh.hostkeys import known_hosts_path, unpin
from provision.transport.ssh.sftp_files import _sftp_makedirs, _sftp_mkdir, _sftp_put, _sftp_remove

if TYPE_CHECKING:
    from fabric import Connection

IO_TIMEOUT = 30.0  # an SFTP reply slower than this means a hung connection (half-open TCP)
_T = TypeVar("_T")
Feed = Callable[[paramiko.Channel], None]  # writes a command's input into its channel
_M = TypeVar("_M")


# --- connections ---------------------------------------------------------------------------

# (user, address, port, identity file, known_hosts path, route) -> an open fabric Connection
_POOL: dict[tuple[str, str, int, str | None, str, str], Connection] = {}
_POOL_LOCK = threading.Lock()


def _close_all() -> None:
    with _POOL_LOCK:
        conns = list(_POOL.values())
        _POOL.clear()
    for conn in conns:
        close_chain(conn)


atexit.register(_close_all)


def _forget_connections(address: str, port: int | None) -> None:
    with _POOL_LOCK:
        keys = [k for k in _POOL if k[1] == address and (port is None or k[2] == port)]
        conns = [_POOL.pop(k) for k in keys]
    for conn in conns:
        close_chain(conn)


def parse_host_spec(spec: str) -> tuple[str | None, str, int | None]:
    """`user@host:port` -> (user, host, port); user and port may be absent."""
    from provision.transport.ssh.aliases import split_spec

    return split_spec(spec)


def forget_host(spec: str) -> int:
    """Drop the pinned keys of a host (every port when none is given). Returns lines removed."""
    _user, host, port = parse_host_spec(spec)
    removed = unpin(host, port)
    _forget_connections(host, port)
    return removed


# --- the node ------------------------------------------------------------------------------


class SSHNode(Node):
    """A machine reached over SSH; see the module docstring."""

    def __init__(
        self,
        address: str,
        port: int = 22,
        user: str = "root",
        identity_file: str | None = None,
        *,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        pin_new: bool = False,
        label: str | None = None,
        io_timeout: float = IO_TIMEOUT,
        route: SSHRoute | None = None,
    ):
        self.address = address
        self.port = int(port)
        self.user = user
        self.identity_file = identity_file
        self.connect_timeout = connect_timeout
        self.pin_new = pin_new
        self.io_timeout = io_timeout
        self.route = route
        via = f" via {route.jumps[-1].where}" if route and route.jumps else ""
        self.label = label or endpoint(user, address, self.port) + via
        # The known_hosts file is part of the key: a connection checked against another state
        # dir's pins (tests, GPUCTL_STATE_DIR switches) is not reused.
        way = route.model_dump_json() if route else ""
        self._key = (user, address, self.port, identity_file, str(known_hosts_path()), way)

    @classmethod
    def from_record(cls, node: state.NodeRecord, identity_file: str | None = None, **kw: Any) -> SSHNode:
        return cls(node.address, node.port, node.user or "root", identity_file, route=node.ssh, **kw)

    # connection ---------------------------------------------------------------------------
    def connection(self) -> Connection:
        """The process-wide fabric Connection to this host (through its jump hosts), (re)opened
        when missing or broken."""
        with _POOL_LOCK:
            conn = _POOL.get(self._key)
            if conn is not None:
                if conn.is_connected:
                    return conn
                _POOL.pop(self._key, None)
        if conn is not None:
            close_chain(conn)
        fresh = open_connection(
            self.address,
            self.port,
            self.user,
            self.identity_file,
            route=self.route,
            timeout=self.connect_timeout,
            pin_new=self.pin_new,
        )
        with _POOL_LOCK:
            other = _POOL.get(self._key)
            if other is not None and other.is_connected:
                close_chain(fresh)
                return other
            _POOL[self._key] = fresh
        return fresh

    def client(self) -> paramiko.SSHClient:
        """The paramiko client of the pooled connection."""
        return self.connection().client

    def drop_connection(self) -> None:
        """Close the pooled connection (after an error, so the next call reconnects)."""
        with _POOL_LOCK:
            conn = _POOL.pop(self._key, None)
        if conn is not None:
            close_chain(conn)

    def close(self) -> None:
        """Release this handle. A healthy pooled connection stays for the rest of the process."""
        with _POOL_LOCK:
            conn = _POOL.get(self._key)
        if conn is not None and not conn.is_connected:
            self.drop_connection()

    def _lost(self, exc: BaseException) -> RemoteError:
        """The connection broke under a command: drop it (the next call reconnects) and say so."""
        self.drop_connection()
        return RemoteError(
            f"{self.label}: connection lost ({exc or type(exc).__name__})",
            "check the node; gpuctl reconnects on the next command",
        )

    # commands -----------------------------------------------------------------------------
    def _execute(
        self, argv: list[str], timeout: float | None, stream: LineSink | None, stdin: bytes | None | Feed
    ) -> CommandResult:
        """stdin: bytes, or a function that writes the command's input into the channel (a stream)."""
        command = shlex.join(str(a) for a in argv)
        transport = self.client().get_transport()
        try:
            chan = transport.open_session(timeout=self.connect_timeout)
        except (paramiko.SSHException, OSError, EOFError) as exc:
            raise self._lost(exc) from None
        try:
            return self._exchange(chan, command, timeout, stream, stdin)
        finally:
            chan.close()

    def _exchange(
        self,
        chan: paramiko.Channel,
        command: str,
        timeout: float | None,
        stream: LineSink | None,
        stdin: bytes | None | Feed,
    ) -> CommandResult:
        deadline = time.monotonic() + timeout if timeout else None
        wait_s = timeout or self.connect_timeout + 30  # for one answer of the node (without a deadline too)
        out, err = bytearray(), bytearray()
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        pending = ""
        try:
            answered_within(chan, lambda: chan.exec_command(command), wait_s)
            chan.settimeout(wait_s)  # sendall below: a node that takes no input
            if callable(stdin):
                stdin(chan)
            elif stdin:
                chan.sendall(stdin)
            chan.shutdown_write()
            while True:
                interrupt.check()  # a Ctrl-C that a finalizer swallowed (core/interrupt.py)
                select.select([chan], [], [], 0.5)
                while chan.recv_ready():
                    data = chan.recv(65536)
                    out += data
                    if stream:
                        pending += decoder.decode(data)
                        *lines, pending = pending.split("\n")
                        for line in lines:
                            stream(line)
                while chan.recv_stderr_ready():
                    err += chan.recv_stderr(65536)
                if chan.eof_received and not chan.recv_ready() and not chan.recv_stderr_ready():
                    break
                if chan.closed or not chan.get_transport().is_active():
                    raise EOFError("connection closed")
                if deadline and time.monotonic() > deadline:
                    raise TimeoutError
            left = max(0.1, deadline - time.monotonic()) if deadline else wait_s
            if not chan.status_event.wait(left):
                raise TimeoutError
        except TimeoutError:
            # the command, or the connection under it, hangs: the next call starts a fresh one
            self.drop_connection()
            raise RemoteError(f"{self.label}: {command[:120]} timed out after {wait_s:g}s") from None
        except (paramiko.SSHException, OSError, EOFError) as exc:
            raise self._lost(exc) from None
        if stream:
            pending += decoder.decode(b"", final=True)
            if pending:
                stream(pending)
        return CommandResult(chan.recv_exit_status(), out.decode("utf-8", "replace"), err.decode("utf-8", "replace"))

    def warm(self) -> None:
        """Connect now (train: while the bundle renders); a failure is reported by the next command."""
        try:
            self.connection()
        except RemoteError:
            pass

    def ship_and_start(
        self, local: Path, remote: str, script: str, log: str, starting: ExitStack, restarts: int = 0
    ) -> int:
        """put_dir + start_detached in one exec channel (transport/ssh/ship.py); over SFTP on a node
        without tar; nothing restarts a run here (restarts: a batch scheduler's). A Ctrl-C while the tar goes out cuts it (the node's tar fails: nothing starts);
        from its last byte on, the start is deferred as the base method's is."""
        from provision.transport.ssh.ship import NO_TAR, SHIP_SCRIPT, ChannelFile, write_tar

        sent: list[ChannelFile] = []

        def feed(chan: paramiko.Channel) -> None:
            sent.append(ChannelFile(chan))
            write_tar(Path(local), sent[0])
            starting.enter_context(interrupt.deferred())

        result = self._execute(["bash", "-c", SHIP_SCRIPT, "gpuctl", remote, script, log], None, None, feed)
        if result.rc == NO_TAR:
            starting.close()  # nothing started: a Ctrl-C from here stops the SFTP copy again
            return super().ship_and_start(local, remote, script, log, starting)
        try:
            if result.rc == 0:
                return int(result.stdout.split()[-1])
        except (ValueError, IndexError):
            pass
        broken = f" (sending stopped: {sent[0].broken})" if sent and sent[0].broken else ""
        said = (result.stderr.strip() or result.stdout.strip()).splitlines()
        detail = "; ".join(line.strip() for line in said if line.strip())[-300:]  # one line
        raise RemoteError(f"{self.label}: shipping {local} to {remote} and starting {script} failed: {detail}{broken}")

    # files --------------------------------------------------------------------------------
    def _sftp(self) -> paramiko.SFTPClient:
        """An SFTP session kept with the pooled connection (reads skip the login shell)."""
        client = self.client()
        sftp = getattr(client, "_gpuctl_sftp", None)
        if sftp is None or sftp.sock.closed:  # client.open_sftp(), with timeouts on every wait
            chan = client.get_transport().open_session(timeout=self.connect_timeout)
            chan.settimeout(self.io_timeout)
            answered_within(chan, lambda: chan.invoke_subsystem("sftp"), self.io_timeout)
            sftp = paramiko.SFTPClient(chan)
            client._gpuctl_sftp = sftp
        sftp.get_channel().settimeout(self.io_timeout)
        return sftp

    def _over_sftp(self, path: str, action: Callable[[paramiko.SFTPClient], _T], missing: _M) -> _T | _M:
        """Run a file action over the kept SFTP session; `missing` when the file is not there
        (or unreadable); RemoteError when the connection is gone."""
        try:
            return action(self._sftp())
        except (paramiko.SSHException, OSError, EOFError) as exc:
            with _POOL_LOCK:
                conn = _POOL.get(self._key)
            alive = conn is not None and conn.is_connected and not isinstance(exc, TimeoutError)
            if isinstance(exc, OSError) and alive:
                return missing  # missing, a folder, no permission: like `[ -f ] && cat` failing
            self.drop_connection()
            raise RemoteError(
                f"{self.label}: connection lost reading {path} ({exc or type(exc).__name__})",
                "check the node; gpuctl reconnects on the next command",
            ) from None

    def read_text(self, path: str, limit: int | None = None) -> str | None:
        """A file's text, or None when it is missing or unreadable (over SFTP: no shell start);
        TooLarge (nothing read) when it has more than `limit` bytes."""

        def read(sftp: paramiko.SFTPClient) -> str:
            with sftp.open(path, "rb") as fh:
                return read_whole(fh, fh.stat().st_size or 0, path, limit)

        return self._over_sftp(path, read, None)

    def read_new(self, path: str, offset: int, limit: int = READ_BYTES) -> tuple[str, int]:
        """New bytes of a growing file from `offset` (at most `limit`), cut before a partly written UTF-8 character."""

        def read(sftp: paramiko.SFTPClient) -> tuple[str, int]:
            with sftp.open(path, "rb") as fh:
                size = fh.stat().st_size or 0
                if min(size - offset, limit) > 256 * 1024:
                    fh.prefetch(min(size, offset + limit))  # a long log on first attach: pipelined reads
                return read_from(fh, size, offset, limit)

        return self._over_sftp(path, read, ("", offset))

    def last_line(self, path: str) -> str:
        def read(sftp: paramiko.SFTPClient) -> str:
            with sftp.open(path, "rb") as fh:
                return last_line_of(fh, fh.stat().st_size or 0)

        return self._over_sftp(path, read, "")

    def file_size(self, path: str) -> int | None:
        """One SFTP stat (0 when the file is not there yet); RemoteError when the connection is gone."""
        return self._over_sftp(path, lambda sftp: sftp.stat(path).st_size or 0, 0)

    def group_alive(self, pgid: int) -> bool:
        """The group's leader (launch.sh) alive means the group is: one SFTP stat, no shell.
        Only when the leader is gone does it ask the shell whether members are left."""

        def leader(sftp: paramiko.SFTPClient) -> bool:
            sftp.stat(f"/proc/{int(pgid)}")
            return True

        return bool(self._over_sftp(f"/proc/{pgid}", leader, False)) or super().group_alive(pgid)

    def put_dir(self, local: Path, remote: str) -> None:
        """Copy a local folder to `remote` over SFTP (created 0700), minus ignored files."""
        local = Path(local)
        try:
            sftp = self._sftp()  # the kept session: the node starts its sftp-server once per process
        except (paramiko.SSHException, OSError, EOFError) as exc:
            self.drop_connection()
            raise RemoteError(
                f"{self.label}: SFTP failed to start ({exc})", "check that the node's sshd has the sftp subsystem"
            ) from None
        try:
            _sftp_makedirs(sftp, remote)
            for rel, path, kind in walk_shipped(local):
                target = posixpath.join(remote, rel)
                if kind == "dir":
                    _sftp_mkdir(sftp, target, 0o700)
                elif kind == "link":
                    _sftp_remove(sftp, target)
                    sftp.symlink(os.readlink(path), target)
                else:
                    _sftp_put(sftp, path, target)
        except (paramiko.SSHException, OSError, EOFError) as exc:
            transport = sftp.get_channel().get_transport()
            if transport is None or not transport.is_active() or isinstance(exc, TimeoutError):
                self.drop_connection()
            raise RemoteError(f"{self.label}: copying {local} to {remote} failed: {exc}") from None
