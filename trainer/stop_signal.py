"""Save and stop on a signal: a batch scheduler's warning before the walltime (Slurm's --signal=USR1@N).

The launcher names the signal in GPUCTL_STOP_SIGNAL (provision/providers/slurm.py sets it); without
it nothing is installed and the loop pays nothing. A rank that gets the signal only sets a flag: the
ranks may get it at different steps, so after each step they agree on it with one tiny all-reduce
(MAX), save one checkpoint together and stop. The run then ends with EXIT_CODE, not as a success: it
did not reach max_steps, and `gpuctl train --resume` continues from that checkpoint.
No torch at import: __main__ installs the handler before the heavy imports.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from typing import Any

ENV = "GPUCTL_STOP_SIGNAL"
SIGNALS = ("USR1", "USR2")
EXIT_CODE = 75  # EX_TEMPFAIL: stopped early on purpose, checkpoint saved


class StopSignal:
    """name None: no signal asked for (then agreed() is False and costs nothing)."""

    def __init__(self, name: str | None):
        self.name, self.seen, self.stopped = name, False, False
        if name:
            signal.signal(getattr(signal, f"SIG{name}"), self._on_signal)

    def _on_signal(self, _signum: int, _frame: Any) -> None:
        self.seen = True  # only a flag: the step in flight finishes, the ranks agree after it

    def agreed(self) -> bool:
        """Whether any rank got the signal (collective: every rank calls it after each step)."""
        if not self.name:
            return False
        import torch
        import torch.distributed as dist
        from deepspeed.accelerator import get_accelerator

        flag = torch.tensor([int(self.seen)], dtype=torch.int32, device=get_accelerator().current_device_name())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.stopped = bool(flag.item())
        return self.stopped

    def note(self, summary: dict[str, Any], say: Callable[[str], None]) -> dict[str, Any]:
        """summary.json's content, marked when the run stopped on the signal."""
        if self.stopped:
            summary.update(state="stopped", stopped_by=f"SIG{self.name}")
            say(f"SIG{self.name}: saved step {summary['steps']} and stopped early; `gpuctl train --resume` continues")
        return summary


def install() -> StopSignal:
    name = os.environ.get(ENV, "")
    return StopSignal(name if name in SIGNALS else None)
