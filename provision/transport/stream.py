"""Feed a stream of bytes (GBs: an image, a build context) into a command on a node.

`Node.run(stdin=bytes)` holds its input in memory; `pipe_into` reads chunks from an iterator
and writes them as the command consumes them, while draining its output so neither side
can stall. Works for LocalNode (a subprocess) and SSHNode (one paramiko channel).
"""

from __future__ import annotations

import io
import shlex
import subprocess
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from provision.core.errors import RemoteError
from provision.transport.remote import CommandResult, LocalNode, Node

if TYPE_CHECKING:
    from provision.transport.ssh.node import SSHNode

ByteSink = Callable[[int], None]


def pipe_into(
    node: Node, argv: list[str], chunks: Iterable[bytes], *, on_bytes: ByteSink | None = None, check: bool = True
) -> CommandResult:
    """Run argv on node with chunks as its stdin; on_bytes(n) after each chunk is handed over."""
    if isinstance(node, LocalNode):
        result = _local(argv, chunks, on_bytes)
    else:
        from provision.transport.ssh.node import SSHNode

        if not isinstance(node, SSHNode):
            raise RemoteError(f"{node.label}: cannot stream into {type(node).__name__}")
        result = _ssh(node, argv, chunks, on_bytes)
    if check and result.rc != 0:
        detail = (result.stderr.strip() or result.stdout.strip())[-300:]
        raise RemoteError(f"{node.label}: {argv[0]} exited {result.rc}: {detail}")
    return result


def _drain(read: Callable[[], bytes], into: bytearray) -> threading.Thread:
    def pump() -> None:
        while True:
            data = read()
            if not data:
                return
            into.extend(data)

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    return thread


def _local(argv: list[str], chunks: Iterable[bytes], on_bytes: ByteSink | None) -> CommandResult:
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    except OSError as exc:
        raise RemoteError(f"localhost: cannot run {argv[0]}: {exc.strerror}") from None
    stdin, stdout, stderr = proc.stdin, proc.stdout, proc.stderr
    # all three are PIPEs, buffered (bufsize -1): stdout and stderr are BufferedReaders
    assert stdin is not None and isinstance(stdout, io.BufferedReader) and isinstance(stderr, io.BufferedReader)
    out, err = bytearray(), bytearray()
    pumps = [_drain(lambda: stdout.read1(65536), out), _drain(lambda: stderr.read1(65536), err)]
    try:
        for chunk in chunks:
            stdin.write(chunk)
            if on_bytes:
                on_bytes(len(chunk))
    except BrokenPipeError:
        pass  # the command stopped reading; its exit code and stderr say why
    finally:
        try:
            stdin.close()
        except BrokenPipeError:
            pass
    rc = proc.wait()
    for pump in pumps:
        pump.join()
    return CommandResult(rc, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"))


def _ssh(node: SSHNode, argv: list[str], chunks: Iterable[bytes], on_bytes: ByteSink | None) -> CommandResult:
    import paramiko

    from provision.transport.ssh.channel import answered_within

    command = shlex.join(str(a) for a in argv)
    lost = (paramiko.SSHException, OSError, EOFError)  # a node that never answers the exec: TimeoutError
    try:
        chan = node.client().get_transport().open_session(timeout=node.connect_timeout)
        answered_within(chan, lambda: chan.exec_command(command), node.connect_timeout + 30)
    except lost as exc:
        node.drop_connection()
        raise RemoteError(
            f"{node.label}: connection lost ({exc or type(exc).__name__})",
            "check the node; gpuctl reconnects on the next command",
        ) from None
    out, err = bytearray(), bytearray()
    # paramiko channels take one sender and one receiver thread at a time.
    pumps = [_drain(lambda: chan.recv(65536), out), _drain(lambda: chan.recv_stderr(65536), err)]
    try:
        try:
            for chunk in chunks:
                if chan.exit_status_ready():
                    break  # the command ended early (an error): stop sending
                chan.sendall(chunk)
                if on_bytes:
                    on_bytes(len(chunk))
        except lost:
            if not chan.exit_status_ready() and not chan.get_transport().is_active():
                node.drop_connection()
                raise RemoteError(
                    f"{node.label}: connection lost while streaming to {argv[0]}",
                    "retry; a half-sent stream changes nothing on the node",
                ) from None
        if not chan.closed:
            chan.shutdown_write()
        while not chan.status_event.wait(1.0):
            if not chan.get_transport().is_active():
                node.drop_connection()
                raise RemoteError(
                    f"{node.label}: connection lost waiting for {argv[0]}",
                    "check the node; gpuctl reconnects on the next command",
                )
        rc = chan.recv_exit_status()
        for pump in pumps:
            pump.join(timeout=30)
    finally:
        chan.close()
    return CommandResult(rc, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"))
