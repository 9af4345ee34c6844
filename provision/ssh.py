"""SSH transport: SSHNode (remote.Node over paramiko), pinned host keys, wait_for_ssh.

Public helpers (the cloud providers reuse them):

``SSHNode(address, port=22, user="root", identity_file=None, *, connect_timeout=15,
pin_new=False, label=None)``
    A remote.Node over SSH. Commands are argv lists joined with shlex.join, so user values
    arrive verbatim. One paramiko connection per (user, address, port, key) per gpuctl
    process, opened on first use and reused by every SSHNode for that host; a broken one is
    dropped and the next call reconnects. ``pin_new=True`` (only `gpuctl up`, on first
    contact) records an unknown host key in gpuctl's known_hosts; otherwise an unknown key is
    refused, and a changed key is always refused (`gpuctl forget-host HOST` resets it).
    Every failure is a RemoteError with one line; connection failures are ConnectError,
    whose ``transient`` says whether retrying can help (refused, timeout, no banner yet).

``wait_for_ssh(address, port, deadline, *, say=None, probe_timeout=5.0) -> str``
    Poll until an SSH server answers on address:port with its banner (``SSH-2.0-...``, not
    merely an open TCP port: a cloud node's port forwarder accepts long before sshd runs).
    ``deadline`` is a ``time.monotonic()`` instant. Returns the banner line; raises
    ConnectError (transient=True) naming the last problem when the deadline passes.

``known_hosts_path() -> Path``: gpuctl's own known_hosts (OpenSSH format, under the state
dir); ``forget_host(spec) -> int`` removes a host's pinned keys (``host``, ``host:port`` or
``user@host:port``) and returns how many lines went.
"""

from __future__ import annotations

import atexit
import codecs
import logging
import os
import posixpath
import re
import select
import shlex
import socket
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import paramiko

from provision import state
from provision.errors import RemoteError
from provision.remote import CommandResult, LineSink, Node

# paramiko logs a dropped connection ("Socket exception: Connection reset") from its reader
# thread; gpuctl reports it as one RemoteError line instead. GPUCTL_DEBUG=1 shows the logs.
if os.environ.get("GPUCTL_DEBUG", "") in ("", "0"):
    logging.getLogger("paramiko").setLevel(logging.CRITICAL + 1)

DEFAULT_CONNECT_TIMEOUT = 15.0
IO_TIMEOUT = 30.0  # an SFTP reply slower than this means a hung connection (half-open TCP)
KEEPALIVE_S = 15
IGNORE_FILES = (".gitignore", ".gpuctlignore")


class ConnectError(RemoteError):
    """Could not open an SSH session. `transient`: a booting node can still become ready."""

    def __init__(self, message: str, fix: str | None = None, *, transient: bool = False):
        super().__init__(message, fix)
        self.transient = transient


class UnknownHostKey(paramiko.SSHException):
    def __init__(self, hostname: str, key: paramiko.PKey):
        super().__init__(f"unknown host key for {hostname}")
        self.hostname = hostname
        self.key = key


# --- gpuctl's known_hosts ------------------------------------------------------------------

def known_hosts_path() -> Path:
    return state.state_dir() / "known_hosts"


def host_key_name(address: str, port: int) -> str:
    """How OpenSSH and paramiko name a host in known_hosts."""
    return address if port == 22 else f"[{address}]:{port}"


def load_known_hosts() -> paramiko.HostKeys:
    keys = paramiko.HostKeys()
    path = known_hosts_path()
    if path.is_file():
        keys.load(str(path))
    return keys


def pin_host_key(name: str, key: paramiko.PKey) -> None:
    """Record a host key on first contact (under the state lock; never replaces a key)."""
    with state.locked():
        keys = load_known_hosts()
        known = keys.lookup(name)
        if known is not None and key.get_name() in known:
            if known[key.get_name()] != key:
                raise paramiko.BadHostKeyException(name, key, known[key.get_name()])
            return
        keys.add(name, key.get_name(), key)
        _save_known_hosts(keys)


def _save_known_hosts(keys: paramiko.HostKeys) -> None:
    lines = []
    for entry in keys._entries:  # HostKeys.save writes in place; we want an atomic replace
        line = entry.to_line()
        if line:
            lines.append(line)
    state.write_atomic(known_hosts_path(), "".join(lines), 0o600)


def parse_host_spec(spec: str) -> tuple[str | None, str, int | None]:
    """`user@host:port` -> (user, host, port); user and port may be absent."""
    from provision.config import HOST_RE

    match = HOST_RE.match(spec.strip())
    if not match:
        raise RemoteError(f"{spec!r} is not host, host:port or user@host:port")
    return match["user"], match["host"], int(match["port"]) if match["port"] else None


def forget_host(spec: str) -> int:
    """Drop the pinned keys of a host (every port when none is given). Returns lines removed."""
    _user, host, port = parse_host_spec(spec)
    names = {host_key_name(host, port)} if port else None
    with state.locked():
        keys = load_known_hosts()
        kept = []
        removed = 0
        for entry in keys._entries:
            hit = any(n == host_key_name(host, port) if names else
                      (n == host or re.fullmatch(rf"\[{re.escape(host)}\]:\d+", n))
                      for n in entry.hostnames)
            if hit:
                removed += 1
            else:
                kept.append(entry)
        keys._entries = kept
        if removed:
            _save_known_hosts(keys)
    _forget_connections(host, port)
    return removed


class _PinPolicy(paramiko.MissingHostKeyPolicy):
    """Unknown key: record it only when pinning is allowed (first contact in `up`), else refuse.

    A changed key never reaches the policy: paramiko raises BadHostKeyException itself
    because the pinned keys are loaded into the client before connecting.
    """

    def __init__(self, pin_new: bool):
        self.pin_new = pin_new

    def missing_host_key(self, client, hostname, key):
        if not self.pin_new:
            raise UnknownHostKey(hostname, key)
        pin_host_key(hostname, key)


# --- connections ---------------------------------------------------------------------------

_POOL: dict[tuple, paramiko.SSHClient] = {}
_POOL_LOCK = threading.Lock()


def _close_all() -> None:
    with _POOL_LOCK:
        clients = list(_POOL.values())
        _POOL.clear()
    for client in clients:
        client.close()


atexit.register(_close_all)


def _forget_connections(address: str, port: int | None) -> None:
    with _POOL_LOCK:
        keys = [k for k in _POOL if k[1] == address and (port is None or k[2] == port)]
        clients = [_POOL.pop(k) for k in keys]
    for client in clients:
        client.close()


def _where(user: str, address: str, port: int) -> str:
    return f"{user}@{address}:{port}"


def _connect_error(exc: BaseException, user: str, address: str, port: int, timeout: float,
                   identity_file: str | None) -> ConnectError:
    """One line for each way a connection fails, with the next thing to try."""
    where = _where(user, address, port)
    if isinstance(exc, paramiko.BadHostKeyException):
        return ConnectError(
            f"{where}: host key CHANGED (now {exc.key.get_name()} {exc.key.fingerprint}, pinned "
            f"{exc.expected_key.fingerprint}); refusing to connect",
            f"if the machine was really reinstalled, run `gpuctl forget-host {address}:{port}`, then `gpuctl up`")
    if isinstance(exc, UnknownHostKey):
        return ConnectError(f"{where}: host key {exc.key.get_name()} {exc.key.fingerprint} is not pinned by gpuctl",
                            "run `gpuctl up` to connect and pin it")
    if isinstance(exc, paramiko.AuthenticationException):
        what = f"key {identity_file}" if identity_file else "your SSH agent/default keys"
        return ConnectError(f"{where}: authentication failed with {what}",
                            "check provider.identity_file and that its public key is in the node's authorized_keys")
    if isinstance(exc, paramiko.ssh_exception.NoValidConnectionsError):
        first = next(iter(exc.errors.values()), None)  # refused/unreachable on every address
        if isinstance(first, OSError):
            exc = first
    if isinstance(exc, socket.gaierror):
        return ConnectError(f"{where}: cannot resolve host {address!r} ({exc.strerror})",
                            "check the host name in provider.hosts", transient=True)
    if isinstance(exc, ConnectionRefusedError):
        return ConnectError(f"{where}: connection refused (no SSH server on port {port})",
                            "check the port in provider.hosts and that sshd runs", transient=True)
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return ConnectError(f"{where}: no answer within {timeout:g}s (host unreachable or down)",
                            "check the address and your network; a booting node needs a minute", transient=True)
    # paramiko: "Error reading SSH protocol banner", or "No existing session" when its
    # handshake wait (the same timeout) ran out first
    if isinstance(exc, paramiko.SSHException) and ("banner" in str(exc).lower() or "No existing session" in str(exc)):
        return ConnectError(f"{where}: no SSH banner within {timeout:g}s (not an SSH server, or it is overloaded)",
                            "check the port in provider.hosts", transient=True)
    if isinstance(exc, OSError) and exc.errno is not None:
        return ConnectError(f"{where}: {exc.strerror or exc}", "check the address and port", transient=True)
    return ConnectError(f"{where}: SSH connection failed: {exc or type(exc).__name__}",
                        "retry; GPUCTL_DEBUG=1 shows the details", transient=True)


def open_client(address: str, port: int, user: str, identity_file: str | None, *,
                timeout: float = DEFAULT_CONNECT_TIMEOUT, pin_new: bool = False) -> paramiko.SSHClient:
    """A new authenticated paramiko client; host key checked against gpuctl's known_hosts."""
    client = paramiko.SSHClient()
    path = known_hosts_path()
    if path.is_file():
        client.load_system_host_keys(str(path))  # checked, never written back by paramiko
    client.set_missing_host_key_policy(_PinPolicy(pin_new))
    key_file = str(Path(identity_file).expanduser()) if identity_file else None
    try:
        client.connect(address, port=port, username=user, key_filename=key_file,
                       look_for_keys=key_file is None, allow_agent=key_file is None,
                       timeout=timeout, banner_timeout=timeout, auth_timeout=timeout,
                       channel_timeout=timeout)
    except (paramiko.SSHException, OSError, EOFError) as exc:
        client.close()
        raise _connect_error(exc, user, address, port, timeout, identity_file) from None
    transport = client.get_transport()
    transport.set_keepalive(KEEPALIVE_S)
    return client


def wait_for_ssh(address: str, port: int, deadline: float, *, say: Callable[[str], None] | None = None,
                 probe_timeout: float = 5.0) -> str:
    """Wait until address:port answers with an SSH banner; see the module docstring."""
    delay, last = 0.5, "not tried"
    while time.monotonic() < deadline:
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
    raise ConnectError(f"{address}:{port}: no SSH server answered before the deadline ({last})",
                       "check the node in the provider's console; `gpuctl down` removes it", transient=True)


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


# --- the node ------------------------------------------------------------------------------

class SSHNode(Node):
    """A machine reached over SSH; see the module docstring."""

    def __init__(self, address: str, port: int = 22, user: str = "root", identity_file: str | None = None,
                 *, connect_timeout: float = DEFAULT_CONNECT_TIMEOUT, pin_new: bool = False,
                 label: str | None = None, io_timeout: float = IO_TIMEOUT):
        self.address = address
        self.port = int(port)
        self.user = user
        self.identity_file = identity_file
        self.connect_timeout = connect_timeout
        self.pin_new = pin_new
        self.io_timeout = io_timeout
        self.label = label or _where(user, address, self.port)
        # The known_hosts file is part of the key: a connection checked against another state
        # dir's pins (tests, GPUCTL_STATE_DIR switches) is not reused.
        self._key = (user, address, self.port, identity_file, str(known_hosts_path()))

    @classmethod
    def from_record(cls, node: "state.NodeRecord", identity_file: str | None = None, **kw) -> "SSHNode":
        return cls(node.address, node.port, node.user or "root", identity_file, **kw)

    # connection ---------------------------------------------------------------------------
    def client(self) -> paramiko.SSHClient:
        """The process-wide connection to this host, (re)opened when missing or broken."""
        with _POOL_LOCK:
            client = _POOL.get(self._key)
            if client is not None:
                transport = client.get_transport()
                if transport is not None and transport.is_active():
                    return client
                _POOL.pop(self._key, None)
        if client is not None:
            client.close()
        fresh = open_client(self.address, self.port, self.user, self.identity_file,
                            timeout=self.connect_timeout, pin_new=self.pin_new)
        with _POOL_LOCK:
            other = _POOL.get(self._key)
            if other is not None and other.get_transport() and other.get_transport().is_active():
                fresh.close()
                return other
            _POOL[self._key] = fresh
        return fresh

    def drop_connection(self) -> None:
        """Close the pooled connection (after an error, so the next call reconnects)."""
        with _POOL_LOCK:
            client = _POOL.pop(self._key, None)
        if client is not None:
            client.close()

    def close(self) -> None:
        """Release this handle. A healthy pooled connection stays for the rest of the process."""
        with _POOL_LOCK:
            client = _POOL.get(self._key)
        transport = client.get_transport() if client else None
        if client is not None and (transport is None or not transport.is_active()):
            self.drop_connection()

    # commands -----------------------------------------------------------------------------
    def run(self, argv: list[str], *, check: bool = True, timeout: float | None = None,
            stream: LineSink | None = None, stdin: bytes | None = None) -> CommandResult:
        command = shlex.join(str(a) for a in argv)
        transport = self.client().get_transport()
        try:
            chan = transport.open_session(timeout=self.connect_timeout)
        except (paramiko.SSHException, OSError, EOFError) as exc:
            self.drop_connection()
            raise RemoteError(f"{self.label}: connection lost ({exc or type(exc).__name__})",
                              "check the node; gpuctl reconnects on the next command") from None
        try:
            result = self._exchange(chan, command, timeout, stream, stdin)
        finally:
            chan.close()
        if check and result.rc != 0:
            detail = (result.stderr.strip() or result.stdout.strip())[-300:]
            raise RemoteError(f"{self.label}: {argv[0] if argv else '?'} exited {result.rc}: {detail}")
        return result

    def _exchange(self, chan: paramiko.Channel, command: str, timeout: float | None,
                  stream: LineSink | None, stdin: bytes | None) -> CommandResult:
        deadline = time.monotonic() + timeout if timeout else None
        out, err = bytearray(), bytearray()
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        pending = ""
        try:
            chan.exec_command(command)
            if stdin:
                chan.sendall(stdin)
            chan.shutdown_write()
            while True:
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
            left = max(0.1, deadline - time.monotonic()) if deadline else self.connect_timeout + 30
            if not chan.status_event.wait(left):
                raise TimeoutError
        except TimeoutError:
            # the command, or the connection under it, hangs: the next call starts a fresh one
            self.drop_connection()
            raise RemoteError(f"{self.label}: {command[:120]} timed out after {timeout}s") from None
        except (paramiko.SSHException, OSError, EOFError) as exc:
            self.drop_connection()
            raise RemoteError(f"{self.label}: connection lost ({exc or type(exc).__name__})",
                              "check the node; gpuctl reconnects on the next command") from None
        if stream:
            pending += decoder.decode(b"", final=True)
            if pending:
                stream(pending)
        return CommandResult(chan.recv_exit_status(), out.decode("utf-8", "replace"),
                             err.decode("utf-8", "replace"))

    # files --------------------------------------------------------------------------------
    def _sftp(self) -> paramiko.SFTPClient:
        """An SFTP session kept with the pooled connection (reads skip the login shell)."""
        client = self.client()
        sftp = getattr(client, "_gpuctl_sftp", None)
        if sftp is None or sftp.sock.closed:
            sftp = client.open_sftp()
            client._gpuctl_sftp = sftp
        sftp.get_channel().settimeout(self.io_timeout)
        return sftp

    def _over_sftp(self, path: str, action: Callable[[paramiko.SFTPClient], object], missing: object) -> object:
        """Run a file action over the kept SFTP session; `missing` when the file is not there
        (or unreadable); RemoteError when the connection is gone."""
        try:
            return action(self._sftp())
        except (paramiko.SSHException, OSError, EOFError) as exc:
            with _POOL_LOCK:
                client = _POOL.get(self._key)
            transport = client.get_transport() if client else None
            alive = transport is not None and transport.is_active() and not isinstance(exc, TimeoutError)
            if isinstance(exc, OSError) and alive:
                return missing  # missing, a folder, no permission: like `[ -f ] && cat` failing
            self.drop_connection()
            raise RemoteError(f"{self.label}: connection lost reading {path} ({exc or type(exc).__name__})",
                              "check the node; gpuctl reconnects on the next command") from None

    def read_text(self, path: str) -> str | None:
        """A file's text, or None when it is missing or unreadable (over SFTP: no shell start)."""
        def read(sftp: paramiko.SFTPClient) -> str:
            with sftp.open(path, "rb") as fh:
                return fh.read().decode("utf-8", "replace")

        return self._over_sftp(path, read, None)

    def read_new(self, path: str, offset: int) -> tuple[str, int]:
        """New bytes of a growing file from `offset`, cut before a partly written UTF-8 character."""
        def read(sftp: paramiko.SFTPClient) -> tuple[str, int]:
            with sftp.open(path, "rb") as fh:
                size = fh.stat().st_size
                if size <= offset:
                    return "", offset
                fh.seek(offset)
                if size - offset > 256 * 1024:
                    fh.prefetch(size)  # a long log on first attach: pipelined reads
                data = fh.read(size - offset)
            end = _complete_utf8(data)
            return data[:end].decode("utf-8", "replace"), offset + end

        return self._over_sftp(path, read, ("", offset))

    def last_line(self, path: str) -> str:
        def read(sftp: paramiko.SFTPClient) -> str:
            with sftp.open(path, "rb") as fh:
                size = fh.stat().st_size
                fh.seek(max(0, size - 65536))
                lines = fh.read().rstrip(b"\n").rsplit(b"\n", 1)
            return lines[-1].decode("utf-8", "replace") if size else ""

        return self._over_sftp(path, read, "")

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
            raise RemoteError(f"{self.label}: SFTP failed to start ({exc})",
                              "check that the node's sshd has the sftp subsystem") from None
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


def _complete_utf8(data: bytes) -> int:
    """Length of the longest prefix of data that does not end inside a UTF-8 character."""
    i = len(data) - 1
    while i >= 0 and len(data) - i < 4 and data[i] & 0xC0 == 0x80:
        i -= 1
    if i < 0 or data[i] < 0xC0:
        return len(data)
    need = 2 if data[i] < 0xE0 else 3 if data[i] < 0xF0 else 4
    return len(data) if len(data) - i >= need else i


def _sftp_put(sftp: paramiko.SFTPClient, path: Path, target: str) -> None:
    """One file in ~2 round trips (open, close; writes pipelined, their errors raised at close).
    The mode is set only when it is not the usual 0644 (a run dir is 0700 anyway)."""
    mode = stat.S_IMODE(path.stat().st_mode)
    with open(path, "rb") as src, sftp.open(target, "wb") as dst:
        dst.set_pipelined(True)
        while chunk := src.read(1 << 20):
            dst.write(chunk)
        if mode != 0o644:
            dst.chmod(mode)


def _sftp_mkdir(sftp: paramiko.SFTPClient, path: str, mode: int) -> None:
    try:
        sftp.mkdir(path, mode)
    except OSError:
        if not stat.S_ISDIR(sftp.stat(path).st_mode):
            raise


def _sftp_makedirs(sftp: paramiko.SFTPClient, path: str) -> None:
    parts = [p for p in path.split("/") if p]
    current = "/" if path.startswith("/") else ""
    for part in parts:
        current = posixpath.join(current, part) if current else part
        try:
            sftp.stat(current)
        except FileNotFoundError:
            _sftp_mkdir(sftp, current, 0o700)


def _sftp_remove(sftp: paramiko.SFTPClient, path: str) -> None:
    try:
        sftp.remove(path)
    except FileNotFoundError:
        pass


# --- .gitignore / .gpuctlignore -------------------------------------------------------------

@dataclass
class IgnoreRule:
    regex: re.Pattern
    negate: bool
    dir_only: bool


def _glob_to_regex(glob: str) -> str:
    """gitignore glob -> regex over a '/'-separated relative path."""
    out, i = [], 0
    while i < len(glob):
        c = glob[i]
        if glob.startswith("**/", i):
            out.append(r"(?:.*/)?")
            i += 3
        elif glob.startswith("/**", i) and i + 3 == len(glob):
            out.append(r"/.*")
            i += 3
        elif glob.startswith("**", i):
            out.append(r".*")
            i += 2
        elif c == "*":
            out.append(r"[^/]*")
            i += 1
        elif c == "?":
            out.append(r"[^/]")
            i += 1
        elif c == "[":
            end = glob.find("]", i + 2)
            if end == -1:
                out.append(re.escape(c))
                i += 1
            else:
                body = glob[i + 1:end].replace("\\", "\\\\")
                out.append("[" + ("^" + body[1:] if body.startswith("!") else body) + "]")
                i = end + 1
        elif c == "\\" and i + 1 < len(glob):
            out.append(re.escape(glob[i + 1]))
            i += 2
        else:
            out.append(re.escape(c))
            i += 1
    return "".join(out)


def parse_ignore(text: str) -> list[IgnoreRule]:
    rules = []
    for raw in text.splitlines():
        line = raw.rstrip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        if negate:
            line = line[1:]
        if line.startswith("\\"):
            line = line[1:]
        dir_only = line.endswith("/")
        line = line.rstrip("/")
        if not line:
            continue
        anchored = "/" in line
        body = _glob_to_regex(line.lstrip("/"))
        pattern = body if anchored else r"(?:.*/)?" + body
        rules.append(IgnoreRule(re.compile(rf"^{pattern}$", re.S), negate, dir_only))
    return rules


def walk_shipped(root: Path) -> Iterator[tuple[str, Path, str]]:
    """(relative path, local path, 'dir'|'file'|'link') for what put_dir ships, parents first.

    Ignore files in any folder apply below it, as git does; the last matching rule wins, and
    an ignored folder is skipped whole.
    """
    def rules_in(folder: Path, prefix: str) -> list[tuple[str, IgnoreRule]]:
        found = []
        for name in IGNORE_FILES:
            path = folder / name
            if path.is_file():
                found += [(prefix, rule) for rule in parse_ignore(path.read_text(errors="replace"))]
        return found

    def ignored(rel: str, is_dir: bool, rules: list[tuple[str, IgnoreRule]]) -> bool:
        verdict = False
        for prefix, rule in rules:
            if prefix and not rel.startswith(prefix + "/"):
                continue
            sub = rel[len(prefix) + 1:] if prefix else rel
            if rule.dir_only and not is_dir:
                continue
            if rule.regex.match(sub):
                verdict = not rule.negate
        return verdict

    def walk(folder: Path, prefix: str, rules: list) -> Iterator[tuple[str, Path, str]]:
        rules = rules + rules_in(folder, prefix)
        for entry in sorted(os.scandir(folder), key=lambda e: e.name):
            rel = f"{prefix}/{entry.name}" if prefix else entry.name
            path = Path(entry.path)
            if entry.is_symlink():
                if not ignored(rel, False, rules):
                    yield rel, path, "link"
            elif entry.is_dir():
                if not ignored(rel, True, rules):
                    yield rel, path, "dir"
                    yield from walk(path, rel, rules)
            elif entry.is_file() and not ignored(rel, False, rules):
                yield rel, path, "file"

    yield from walk(Path(root), "", [])
