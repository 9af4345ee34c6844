"""How commands reach a node: a local subprocess or SSH, behind the same methods.

Commands are argv lists. The SSH side joins them with shlex.join, so user values arrive
verbatim; nothing is pasted into a shell string unquoted.
"""

from __future__ import annotations

import os
import shlex
import shutil
import stat
import subprocess
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import IO, BinaryIO

from provision.core import interrupt
from provision.core.errors import GpuctlError, RemoteError

LineSink = Callable[[str], None]

# Started in its own session so the whole run is one process group we can signal, and so
# it survives gpuctl (or the SSH connection) going away. The `cd` must not be part of the
# backgrounded list: `cd && setsid ... &` forks a subshell that keeps the caller's stdout
# (an SSH channel or pipe then stays open for the whole run) and whose pid ($!) is not the
# run's process group. A lone simple command is forked and exec'd: $! = setsid's pid = pgid.
# setsid makes the child a process group of its own only once it runs, and the caller may probe or
# signal that group at once (a busy node took seconds: "the budget guard did not start"); so wait, 10 s
# at most, until the group exists or the child is gone, then print the pid (= the pgid).
DETACH_SCRIPT = (
    'cd "$1" || exit 97; setsid nohup bash "$2" > "$3" 2>&1 < /dev/null & pid=$!; n=0; '
    'until kill -0 -- "-$pid" 2>/dev/null || ! kill -0 "$pid" 2>/dev/null || [ "$n" -ge 200 ]; '
    'do sleep 0.05; n=$((n + 1)); done; echo "$pid"'
)


READ_BYTES = 4 << 20  # the most one read_new returns: the rest of a growing file comes next time
GROWTH_TICK_S = 0.05  # wait_for_growth looks this often (a stat: one SFTP round trip, or none on this machine)
CUT_BYTES = 3  # what read_new may leave of a partly written UTF-8 character: not news yet
LAST_LINE_BYTES = 64 << 10  # last_line looks this far back


class TooLarge(GpuctlError):
    """A node's file is bigger than the read allows: it was not read (a node's files are hostile input)."""

    def __init__(self, path: str, size: int, limit: int):
        super().__init__(f"{path} is {size:,} bytes, more than the {limit:,} gpuctl reads", "check the node")
        self.path, self.size, self.limit = path, size, limit


def complete_utf8(data: bytes) -> int:
    """Length of the longest prefix of data that does not end inside a UTF-8 character."""
    i = len(data) - 1
    while i >= 0 and len(data) - i < 4 and data[i] & 0xC0 == 0x80:
        i -= 1
    if i < 0 or data[i] < 0xC0:
        return len(data)
    need = 2 if data[i] < 0xE0 else 3 if data[i] < 0xF0 else 4
    return len(data) if len(data) - i >= need else i


def read_whole(fh: BinaryIO, size: int, path: str, limit: int | None) -> str:
    """An open file's text; TooLarge (nothing read) when it has more than `limit` bytes."""
    if limit is not None and size > limit:
        raise TooLarge(path, size, limit)
    data = fh.read() if limit is None else fh.read(limit + 1)
    if limit is not None and len(data) > limit:  # it grew since the stat
        raise TooLarge(path, len(data), limit)
    return data.decode("utf-8", "replace")


def read_from(fh: BinaryIO, size: int, offset: int, limit: int) -> tuple[str, int]:
    """At most `limit` bytes of an open file from `offset`, cut before a partly written UTF-8
    character; the text and the offset after it."""
    if size <= offset:
        return "", offset
    fh.seek(offset)
    data = fh.read(min(size - offset, limit))
    end = complete_utf8(data) if data else 0
    if end == 0 and len(data) >= 4:  # no whole character at all (not UTF-8): move on anyway
        end = len(data)
    return data[:end].decode("utf-8", "replace"), offset + end


def last_line_of(fh: BinaryIO, size: int) -> str:
    if not size:
        return ""
    fh.seek(max(0, size - LAST_LINE_BYTES))
    lines = fh.read(LAST_LINE_BYTES).rstrip(b"\n").rsplit(b"\n", 1)
    return lines[-1].decode("utf-8", "replace")


@dataclass
class CommandResult:
    rc: int
    stdout: str
    stderr: str


class Node:
    """Shell-level helpers shared by every transport. Subclasses provide _execute and put_dir."""

    label = "node"

    def run(
        self,
        argv: list[str],
        *,
        check: bool = True,
        timeout: float | None = None,
        stream: LineSink | None = None,
        stdin: bytes | None = None,
    ) -> CommandResult:
        """Run argv on the node; stream gets stdout lines as they come; check: non-zero exit raises."""
        result = self._execute(argv, timeout, stream, stdin)
        if check and result.rc != 0:
            detail = (result.stderr.strip() or result.stdout.strip())[-300:]
            raise RemoteError(f"{self.label}: {argv[0] if argv else '?'} exited {result.rc}: {detail}")
        return result

    def _execute(
        self, argv: list[str], timeout: float | None, stream: LineSink | None, stdin: bytes | None
    ) -> CommandResult:
        raise NotImplementedError

    def put_dir(self, local: Path, remote: str) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Release connections; safe to call twice."""

    def sh(
        self, script: str, *args: str, check: bool = True, timeout: float | None = None, stream: LineSink | None = None
    ) -> CommandResult:
        """Run a fixed bash script; values travel as positional args, never pasted into it."""
        return self.run(["bash", "-c", script, "gpuctl", *args], check=check, timeout=timeout, stream=stream)

    def read_text(self, path: str, limit: int | None = None) -> str | None:
        """A file's text, None when it is missing; TooLarge (not read) when over `limit` bytes."""
        script = '[ -f "$1" ] || exit 1; s=$(stat -c %s -- "$1") || exit 1; [ -z "$2" ] || [ "$s" -le "$2" ] || { echo "$s"; exit 3; }; cat -- "$1"'
        result = self.sh(script, path, "" if limit is None else str(limit), check=False, timeout=60)
        if result.rc == 3 and limit is not None:
            raise TooLarge(path, int(result.stdout.strip() or 0), limit)
        return result.stdout if result.rc == 0 else None

    def write_text(self, path: str, text: str, mode: str = "600") -> None:
        # The parent by parameter expansion: $(dirname) would drop a trailing newline of a name.
        script = 'umask 077; case "$1" in */*) d="${1%/*}";; *) d=.;; esac; mkdir -p -- "${d:-/}" && cat > "$1" && chmod "$2" "$1"'
        self.run(["bash", "-c", script, "gpuctl", path, mode], stdin=text.encode(), timeout=60)

    def start_detached(self, cwd: str, script: str, log: str, restarts: int = 0) -> int:
        """Start `bash script` in cwd, detached, output to log; returns its pid (= its pgid).
        restarts: how often a batch scheduler may start it again (provider slurm); nothing restarts it here."""
        out = self.sh(DETACH_SCRIPT, cwd, script, log, timeout=60).stdout.strip()
        try:
            return int(out.splitlines()[-1])
        except (ValueError, IndexError):
            raise RemoteError(f"{self.label}: could not start {script} (got {out!r})") from None

    def ship_and_start(
        self, local: Path, remote: str, script: str, log: str, starting: ExitStack, restarts: int = 0
    ) -> int:
        """put_dir(local, remote), then start_detached(remote, script, log, restarts); its pgid. A Ctrl-C while
        shipping stops it; once the start is under way it waits (interrupt.deferred, entered into
        `starting`) until the caller has recorded the run. A transport that can do both in one
        exchange (SSH: one exec channel) overrides it."""
        self.put_dir(local, remote)
        starting.enter_context(interrupt.deferred())
        return self.start_detached(remote, script, log, restarts)

    def warm(self) -> None:
        """Open what the next command needs (SSH: the connection), so that it can happen while the
        caller does other work; errors are left for that command to report."""

    def read_new(self, path: str, offset: int, limit: int = READ_BYTES) -> tuple[str, int]:
        """What a growing file holds from byte `offset` on (at most `limit` bytes), and the offset after it."""
        script = '[ -f "$1" ] && tail -c +"$2" -- "$1" | head -c "$3"'
        text = self.sh(script, path, str(offset + 1), str(limit), check=False, timeout=60).stdout
        return text, offset + len(text.encode())

    def last_line(self, path: str) -> str:
        """The last line of a file ("" when missing), from its last LAST_LINE_BYTES."""
        script = '[ -f "$1" ] && tail -c "$2" -- "$1" | tail -n 1'
        return self.sh(script, path, str(LAST_LINE_BYTES), check=False, timeout=60).stdout

    def file_size(self, path: str) -> int | None:
        """The file's size when a look is cheap (no shell started on the node); None here."""
        return None

    def wait_for_growth(self, sizes: dict[str, int], timeout: float) -> None:
        """Return once one of these files holds more than the bytes already read of it, or after
        `timeout`: a follow's next read comes when the node wrote a line, not at a fixed poll. A
        node without a cheap look (file_size None) waits the whole timeout, as a poll did."""
        deadline = time.monotonic() + timeout
        while True:
            for path, read in sizes.items():
                size = self.file_size(path)
                if size is None:
                    time.sleep(max(0.0, deadline - time.monotonic()))
                    return
                if size > read + CUT_BYTES:
                    return
            left = deadline - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(GROWTH_TICK_S, left))

    def group_alive(self, pgid: int) -> bool:
        return self.sh('kill -0 -- "-$1" 2>/dev/null', str(pgid), check=False, timeout=30).rc == 0

    def signal_group(self, pgid: int, sig: str = "TERM") -> None:
        self.sh('kill -s "$2" -- "-$1" 2>/dev/null || true', str(pgid), sig, check=False, timeout=30)

    def on_compute(self, argv: list[str], timeout_s: float, name: str = "doctor") -> list[str]:
        """argv as it runs where the run's ranks will (provider slurm: in a short job); here, as is."""
        return argv

    def job_over(self, pgid: int) -> bool:
        """Whether launch.sh's end (status.json) is the run's; a batch scheduler may requeue it (provider slurm)."""
        return True

    def drop_run_secrets(self, run_dir: str) -> None:
        """Remove what a scheduler's job kept of the run's secrets once it is over; launch.sh does it elsewhere."""

    def queue_state(self, pgid: int) -> str | None:
        """What a batch scheduler says of the run (provider slurm: "Slurm job 7 PENDING (Resources)"); None: no scheduler."""
        return None

    def home(self) -> str:
        return self.sh('printf %s "$HOME"', timeout=30).stdout

    def remove_run_secrets(self, workdir: str) -> int:
        """Delete every run's secrets.env (and a Slurm job's secrets.keep) under workdir/runs; how many there
        were. A launch.sh killed with -9 before its ranks started cannot delete its own: `down` calls this."""
        if not workdir.strip("/"):
            return 0  # a record without a workdir: never glob from /
        script = 'n=0; for f in "$1"/runs/*/secrets.env "$1"/runs/*/secrets.keep; do [ -e "$f" ] && rm -f -- "$f" && n=$((n+1)); done; echo "$n"'
        out = self.sh(script, workdir.rstrip("/"), check=False, timeout=60).stdout.strip()
        return int(out) if out.isdigit() else 0


def after_setup(setup: str | None, argv: list[str]) -> list[str]:
    """argv run after provider.setup (module loads, a venv): the user's own shell, in a bash whose
    arguments stay argv's, unpasted."""
    return ["bash", "-c", f'{setup}\nexec "$@"', "gpuctl", *argv] if setup else argv


_WARMING: list[threading.Thread] = []  # warm() calls not yet joined


def warm(nodes: list[Node]) -> None:
    """Each node's warm() in a thread of its own (train: connect while it checks and renders)."""
    for node in nodes:
        thread = threading.Thread(target=node.warm, daemon=True)
        thread.start()
        _WARMING.append(thread)


def warming() -> bool:
    return bool(_WARMING)


def warmed() -> None:
    """Wait for every warm() started: a command after it reuses that connection, not a second one."""
    while _WARMING:
        _WARMING.pop().join()


def _pump(pipe: IO[str], sink: LineSink | None, into: list[str]) -> None:
    for line in iter(pipe.readline, ""):
        into.append(line)
        if sink:
            sink(line.rstrip("\n"))
    pipe.close()


class LocalNode(Node):
    """This machine. Used by provider `local`."""

    label = "localhost"

    def _execute(
        self, argv: list[str], timeout: float | None, stream: LineSink | None, stdin: bytes | None
    ) -> CommandResult:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        out: list[str] = []
        err: list[str] = []
        pumps = [
            threading.Thread(target=_pump, args=(proc.stdout, stream, out), daemon=True),
            threading.Thread(target=_pump, args=(proc.stderr, None, err), daemon=True),
        ]
        for pump in pumps:
            pump.start()
        if stdin is not None:
            assert proc.stdin is not None  # stdin=PIPE
            proc.stdin.write(stdin.decode())
            proc.stdin.close()
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise RemoteError(f"localhost: {shlex.join(argv)[:120]} timed out after {timeout}s") from None
        for pump in pumps:
            pump.join()
        return CommandResult(rc, "".join(out), "".join(err))

    # A local node's files are read here, bounded like an SSH node's (no shell, no decoding of a cut character).
    def read_text(self, path: str, limit: int | None = None) -> str | None:
        try:
            with open(path, "rb") as fh:
                return read_whole(fh, os.fstat(fh.fileno()).st_size, path, limit)
        except OSError:  # missing, a folder, no permission: like `[ -f ] && cat` failing
            return None

    def read_new(self, path: str, offset: int, limit: int = READ_BYTES) -> tuple[str, int]:
        try:
            with open(path, "rb") as fh:
                return read_from(fh, os.fstat(fh.fileno()).st_size, offset, limit)
        except OSError:  # missing, a folder, no permission: like `[ -f ] && cat` failing
            return "", offset

    def last_line(self, path: str) -> str:
        try:
            with open(path, "rb") as fh:
                return last_line_of(fh, os.fstat(fh.fileno()).st_size)
        except OSError:  # missing, a folder, no permission: like `[ -f ] && cat` failing
            return ""

    def file_size(self, path: str) -> int | None:
        try:
            return os.stat(path).st_size
        except OSError:  # not written yet
            return 0

    def put_dir(self, local: Path, remote: str) -> None:
        shutil.copytree(local, remote, dirs_exist_ok=True, symlinks=True, copy_function=copy_with_mode)


def copy_with_mode(src: str, dst: str) -> str:
    """Copy a file with its mode given at creation (copy2 writes the bytes first and chmods after:
    a 0600 secrets.env would sit readable for a moment)."""
    mode = stat.S_IMODE(os.stat(src).st_mode)
    if os.path.lexists(dst):
        os.unlink(dst)
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with open(src, "rb") as fin, os.fdopen(fd, "wb") as fout:
        shutil.copyfileobj(fin, fout, 1 << 20)
    return dst
