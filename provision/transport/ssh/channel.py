"""A channel request that cannot hang for good, below every other SSH module (connect, node, runner, stream).

``answered_within(chan, request, seconds)``
    Send a channel request whose answer paramiko waits for without a timeout (exec_command,
    invoke_subsystem); the channel is closed after ``seconds``, which ends the wait (TimeoutError).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import paramiko

DEFAULT_CONNECT_TIMEOUT = 15.0


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
