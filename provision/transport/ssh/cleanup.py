"""Stopping a cluster's run processes on machines gpuctl does not own (provider ssh's `down`).

``stop_run_processes(nodes, run_dirs, say, grace_s=10) -> int``: TERM, then KILL after the
grace, every process whose cwd is in one of the run dirs, on every node at once (fabric's
ThreadingGroup, through group.run_on_all). Processes are found by their cwd (/proc/PID/cwd),
never by name: DeepSpeed's launcher, pdsh and the ranks all run in the run dir. Returns how
many processes were signalled.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from provision.transport.remote import Node
from provision.transport.ssh.group import run_on_all

# $1 = a signal (0: only list them), $2... = run dirs: signal every process working in one of
# them; prints the pids signalled.
SIGNAL_RUNS = r"""sig=$1; shift
for p in /proc/[0-9]*; do
  c=$(readlink "$p/cwd" 2>/dev/null) || continue
  for d in "$@"; do
    case "$c" in "$d"|"$d"/*) pid=${p#/proc/}; [ "$pid" = "$$" ] || { kill -s "$sig" "$pid" 2>/dev/null && echo "$pid"; }; break;; esac
  done
done; exit 0"""


def signal_runs(nodes: Sequence[Node], run_dirs: list[str], sig: str) -> list[set[str]]:
    results = run_on_all(nodes, ["bash", "-c", SIGNAL_RUNS, "gpuctl", sig, *run_dirs], timeout=60)
    return [set(r.stdout.split()) for r in results]


def stop_run_processes(
    nodes: Sequence[Node], run_dirs: list[str], say: Callable[[str], None], grace_s: float = 10
) -> int:
    if not run_dirs or not nodes:
        return 0
    hit = signal_runs(nodes, run_dirs, "TERM")
    busy = [n for n, pids in zip(nodes, hit, strict=True) if pids]
    deadline = time.monotonic() + grace_s
    while busy and time.monotonic() < deadline:
        time.sleep(0.5)
        left = signal_runs(busy, run_dirs, "0")
        busy = [n for n, pids in zip(busy, left, strict=True) if pids]
    if busy:
        signal_runs(busy, run_dirs, "KILL")
    for node, pids in zip(nodes, hit, strict=True):
        if pids:
            say(f"{node.label}: stopped {len(pids)} run process(es)")
    return sum(len(pids) for pids in hit)
