"""The same command on every node at once: fabric's ThreadingGroup over the nodes' pooled
Connections (their host keys pinned, their jump hosts in place).

``run_on_all(nodes, argv, *, timeout, check=True) -> list[CommandResult]``
    argv is joined with shlex.join (values arrive verbatim), run on every node concurrently,
    results in the nodes' order. A node that fails (exit code with check, a timeout, a lost
    connection) is one RemoteError naming it; the others still ran to the end. Nodes that are
    not SSHNodes (this machine) run one after the other.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from typing import Any

from provision.core.errors import RemoteError
from provision.transport.remote import CommandResult, Node


def run_on_all(nodes: Sequence[Node], argv: list[str], *, timeout: float, check: bool = True) -> list[CommandResult]:
    from fabric import ThreadingGroup
    from fabric.exceptions import GroupException

    from provision.transport.ssh.node import SSHNode

    ssh = [n for n in nodes if isinstance(n, SSHNode)]
    # GroupResult is keyed by Connection, which fabric compares by (host, user, port) only: two
    # nodes alike in that (one private address behind two bastions) go one after the other
    alike = len({(n.address, n.user, n.port) for n in ssh}) < len(ssh)
    if len(ssh) != len(nodes) or len(nodes) < 2 or alike:
        return [n.run(argv, check=check, timeout=timeout) for n in nodes]
    conns = [n.connection() for n in ssh]
    options: dict[str, Any] = {"hide": True, "warn": True, "in_stream": False, "pty": False, "encoding": "utf-8"}
    try:
        results = ThreadingGroup.from_connections(conns).run(shlex.join(argv), timeout=timeout, **options)
    except GroupException as exc:
        results = exc.result
    out: list[CommandResult] = []
    for node, conn in zip(ssh, conns, strict=True):
        result = results[conn]
        if isinstance(result, BaseException):
            raise _failure(node, argv, result, timeout)
        done = CommandResult(result.exited if result.exited is not None else -1, result.stdout, result.stderr)
        if check and done.rc != 0:
            detail = (done.stderr.strip() or done.stdout.strip())[-300:]
            raise RemoteError(f"{node.label}: {argv[0] if argv else '?'} exited {done.rc}: {detail}")
        out.append(done)
    return out


def _failure(node: Any, argv: list[str], exc: BaseException, timeout: float) -> RemoteError:
    from invoke.exceptions import CommandTimedOut

    node.drop_connection()  # a hung or broken connection: the next call opens a fresh one
    if isinstance(exc, CommandTimedOut):
        return RemoteError(f"{node.label}: {shlex.join(argv)[:120]} timed out after {timeout:g}s")
    if isinstance(exc, RemoteError):
        return exc
    return RemoteError(
        f"{node.label}: connection lost ({exc or type(exc).__name__})",
        "check the node; gpuctl reconnects on the next command",
    )
