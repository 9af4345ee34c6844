"""What a preemption test does to the stand-in node (the loopback sshd's machine, this one) and
reads off its run dir: freeze the run past a stored checkpoint, kill what ran on the lost node."""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path

from tests.fakes.harness import wait_until


def kill_the_machine(run_dir: Path) -> None:
    """The rest of a preemption after the fake's `preempt` (the vendor says exited, SSH refuses):
    the node's processes and its disk go."""
    pgid = json.loads((run_dir / "status.json").read_text())["pgid"]
    os.killpg(pgid, signal.SIGKILL)
    wait_until(lambda: not _group_alive(pgid), 30, "the preempted run's processes to end")
    shutil.rmtree(run_dir)  # its disk goes with it


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def signal_run(run_dir: Path, sig: int, *, by_cmdline: bool = False) -> None:
    """Send sig to every process of the run on this machine, found in /proc (a run whose processes
    span nodes or a Slurm step has no one process group to signal).

    Default: the processes whose working dir is the run dir (gpuctl's own rule; with the nodes on one
    file system, every node's). ``by_cmdline``: the Python processes (launcher, ranks) whose command
    line names the run dir or whose working dir starts with it; never slurmstepd or the batch shell,
    which must answer a requeue."""
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if by_cmdline:
                if not Path(os.readlink(proc / "exe")).name.startswith("python"):
                    continue
                named = str(run_dir).encode() in (proc / "cmdline").read_bytes()
                ours = named or os.readlink(proc / "cwd").startswith(str(run_dir))
            else:
                ours = os.readlink(proc / "cwd") == str(run_dir)
            if ours:
                os.kill(int(proc.name), sig)
        except OSError:  # gone meanwhile, or another user's
            continue


def steps(path: Path) -> dict[int, float]:
    """step -> loss of metrics.jsonl's whole lines (the last one may be half written)."""
    losses = {}
    for line in path.read_text().splitlines() if path.is_file() else []:
        if line.endswith("}"):
            row = json.loads(line)
            losses[row["step"]] = row["loss"]
    return losses


def newest_in(store: Path) -> Callable[[], int]:
    """The newest complete checkpoint's step in a file store (its `latest`; 0: none yet)."""

    def newest() -> int:
        latest = (store / "latest").read_text().strip() if (store / "latest").is_file() else ""
        return int(latest.removeprefix("step")) if latest else 0

    return newest


def _past_newest(losses: dict[int, float], stored: int) -> tuple[dict[int, float], int] | None:
    """(the losses so far, the newest stored checkpoint's step) once the run has steps past it."""
    return (losses, stored) if stored and max(losses, default=0) > stored else None


def freeze_past_a_checkpoint(
    run_dir: Path,
    store: Path | Callable[[], int],
    signal_run: Callable[[int], None] | None = None,
    timeout: float = 600.0,
    last_step: int | None = None,
) -> tuple[dict[int, float], int]:
    """Stop the run's processes (SIGSTOP) at a moment when it has run steps past the store's newest
    complete checkpoint; (the losses so far, that checkpoint's step). Nothing moves until the kill.

    On the tiny model that moment may last a step or two (0.1 s each): the next checkpoint is
    published right behind its save. So it is looked for every 20 ms without stopping anything,
    then confirmed with the run stopped. ``store``: a file store's folder, or a function giving the
    newest stored step (0: none; an S3 bucket's). ``signal_run(sig)`` signals every process of the run
    (default: its process group, from status.json). ``last_step``: the run's final step, which it must
    not have reached (nor begun to save) when it stops: a run that got there first fails the test."""
    newest_stored = newest_in(store) if isinstance(store, Path) else store
    if signal_run is None:
        signal_run = functools.partial(os.killpg, json.loads((run_dir / "status.json").read_text())["pgid"])
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        losses = steps(run_dir / "metrics.jsonl")
        assert last_step is None or max(losses, default=0) < last_step, "the run ended before a stored checkpoint"
        if _past_newest(losses, newest_stored()) is None:
            time.sleep(0.02)
            continue
        signal_run(signal.SIGSTOP)
        # it may have published again before it stopped
        found = _past_newest(steps(run_dir / "metrics.jsonl"), newest_stored())
        if found is not None and (last_step is None or _short_of(run_dir, found[0], last_step)):
            return found
        signal_run(signal.SIGCONT)
    raise AssertionError(f"the run never got past a stored checkpoint within {timeout:.0f} s")


def _short_of(run_dir: Path, losses: dict[int, float], last_step: int) -> bool:
    return max(losses, default=0) < last_step and not (run_dir / "checkpoints" / f"step{last_step}").exists()
