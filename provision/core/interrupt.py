"""Ctrl-C while gpuctl holds paid resources: a press is recorded, not only raised.

SIGTERM (a `kill`, a supervisor stopping gpuctl) and SIGHUP (the terminal closed) are answered
as Ctrl-C is: each counts as a press, so an interrupted `up` terminates what it created and
`train` detaches instead of the process dying with an instance nobody records. A signal that
was ignored when gpuctl started (`nohup gpuctl up`) stays ignored. SIGKILL cannot be answered:
`up` records its intent before each vendor call that creates (core/state.py), so `gpuctl down`
finds what a killed `up` left.

CPython raises KeyboardInterrupt in whatever Python code runs when SIGINT arrives. When that
code is a finalizer or a weakref callback, CPython prints "Exception ignored ..." and the
press is gone. Such code runs all the time: importlib runs a weakref callback for every module
it imports (`gpuctl up` imported paramiko, ~200 modules, right after the create call) and
filelock's __del__ runs after every state write. A press lost there let `up` go on booting a
paid instance until its ready_timeout. So `install()` (the CLI does it) puts in a handler
that also records the press, and the places that wait -- vendor requests and polls, SSH
waits and commands, run follows -- call `check()`, which raises a recorded press again.

`check()` leaves alone a press that is on its way up as a KeyboardInterrupt: clean-up code in
an except or finally block (a `docker logout` on the node) still runs; a further Ctrl-C cuts
it, as it always did. Code that answers a press (an abort, a detach) calls `answered()`.

`guarded()` marks the one region whose own handler answers a press: the create-and-boot part
of a cloud `up`, whose abort terminates what it created. There a second press is only counted
until the abort starts (a double Ctrl-C must not hit the abort before it is under way), and
`check()` raises a press on its way too (a vendor call in clean-up code yields to the abort).

`shielded()` is for steps that must finish once begun: terminating what an interrupted `up`
created, recording a run that was just started. Inside it a press is only counted; the step
reads `Shield.presses` and decides (say it goes on, or stop waiting). Nothing is printed from
the handler: it could interrupt a print in progress.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType


@dataclass
class _Presses:
    total: int = 0  # every SIGINT, SIGTERM and SIGHUP since install()
    pending: bool = False  # one was raised (or swallowed) and nothing answered it yet
    shields: int = 0  # shielded() depth
    guards: int = 0  # guarded() depth


_STATE = _Presses()


@dataclass
class Shield:
    start: int

    @property
    def presses(self) -> int:
        """Ctrl-C presses since the shield went up."""
        return _STATE.total - self.start


ANSWERED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _on_sigint(_signum: int, _frame: FrameType | None) -> None:
    _STATE.total += 1
    if _STATE.shields or (_STATE.pending and _STATE.guards):
        return
    _STATE.pending = True
    raise KeyboardInterrupt


def install() -> None:
    """Route SIGINT, SIGTERM and SIGHUP through the recording handler (the main thread only, where
    Python runs handlers); one ignored at start (nohup) stays ignored."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in ANSWERED:
        if signum == signal.SIGINT or signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, _on_sigint)


def check() -> None:
    """Raise a recorded press that no one answered: one that a finalizer swallowed on its way."""
    if not _STATE.pending or _STATE.shields or threading.current_thread() is not threading.main_thread():
        return
    if _STATE.guards or not _on_its_way():
        raise KeyboardInterrupt


def _on_its_way() -> bool:
    """A KeyboardInterrupt is being handled up the stack (clean-up code runs as it propagates)."""
    exc = sys.exc_info()[1]
    while exc is not None:
        if isinstance(exc, KeyboardInterrupt):
            return True
        exc = exc.__context__
    return False


def answered() -> None:
    """The caller handles the KeyboardInterrupt (an abort, a detach): the next press raises again."""
    _STATE.pending = False


@contextmanager
def guarded() -> Iterator[None]:
    """The region whose handler answers a press itself (see the module docstring)."""
    _STATE.guards += 1
    try:
        yield
    finally:
        _STATE.guards -= 1


@contextmanager
def shielded() -> Iterator[Shield]:
    """Presses inside are counted (Shield.presses), never raised; the step acts on them itself."""
    _STATE.shields += 1
    try:
        yield Shield(_STATE.total)
    finally:
        _STATE.shields -= 1


@contextmanager
def deferred() -> Iterator[None]:
    """A step that must finish once begun: a press inside raises when it is done."""
    with shielded() as shield:
        yield
    if shield.presses:
        _STATE.pending = True
        raise KeyboardInterrupt
