"""Waiting for a login closes what each failed try opened (issue 34, item 10).

A node whose sshd accepts TCP but never lets the key in (a pod whose key was not installed) made
`up` retry for minutes while every try kept paramiko's transport: one more thread and one more
socket each time, until the host's sshd dropped connections past MaxStartups. Here: a real sshd
on loopback and a key it does not authorize, 20 tries in this process; the process's threads and
open sockets stay within a small constant of where they started.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from provision.transport.ssh.connect import ConnectError, open_connection
from provision.transport.ssh.node import SSHNode
from tests.sshd import keygen

pytestmark = pytest.mark.timeout(180)
TRIES = 20
SLACK = 2  # a transport thread may still be winding down when the count is taken


def open_sockets() -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:  # the fd of the listdir itself, closed by now
            pass
    return count


def settled(baseline: tuple[int, int], seconds: float = 10) -> tuple[int, int]:
    """(threads, sockets) once they are back within SLACK of the baseline, or after `seconds`."""
    deadline = time.monotonic() + seconds
    while True:
        now = (threading.active_count(), open_sockets())
        if all(n <= b + SLACK for n, b in zip(now, baseline, strict=True)) or time.monotonic() > deadline:
            return now
        time.sleep(0.1)


@pytest.mark.parametrize("how", ["node", "open_connection"])
def test_failed_logins_leave_no_thread_or_socket(sshd, tmp_path, how):
    stranger = str(keygen(tmp_path / "not-authorized"))
    SSHNode("127.0.0.1", sshd.port, sshd.user, str(sshd.client_key), pin_new=True).home()  # pins the host key
    SSHNode("127.0.0.1", sshd.port, sshd.user, str(sshd.client_key)).drop_connection()
    baseline = settled((threading.active_count(), open_sockets()), 0)
    for _ in range(TRIES):
        with pytest.raises(ConnectError, match="authentication failed"):
            if how == "node":  # what cloud.wait_ready retries while it waits for the login
                node = SSHNode("127.0.0.1", sshd.port, sshd.user, stranger, connect_timeout=5)
                try:
                    node.home()
                finally:
                    node.close()
            else:
                open_connection("127.0.0.1", sshd.port, sshd.user, stranger, timeout=5)
    threads, sockets = settled(baseline)
    assert threads <= baseline[0] + SLACK, [t.name for t in threading.enumerate()]
    assert sockets <= baseline[1] + SLACK
