"""The rank's process environment, decided on the node before torch loads (no torch import here).

CPU threads: with ZeRO-Offload every GPU rank runs CPU Adam (DeepSpeed's OpenMP op) on its partition.
Unset, OpenMP gives each rank a thread per core, so N ranks put N x cores threads on the cores at once.
Like DeepSpeed's `--bind_cores_to_rank` (deepspeed/utils/numa.py get_numactl_cmd), each local rank gets
its share of the physical cores: OMP_NUM_THREADS = cores in the share, and the process is bound to them.
Unlike it, the cores are the ones this process may use (a container's cpuset, os.sched_getaffinity), grouped
into physical cores from /sys (hyperthread siblings stay together), and numactl is not needed.
An OMP_NUM_THREADS already in the environment (gpuctl.yaml env, CPU test ranks) wins: nothing is changed.

Pinned memory: see trainer.pinning.
"""

from __future__ import annotations

import os
from pathlib import Path

SYS_CPU = Path("/sys/devices/system/cpu")


def physical_cores(allowed: set[int], sys_cpu: Path = SYS_CPU) -> list[list[int]]:
    """The allowed logical CPUs grouped by physical core (package, core id), in CPU order. A CPU whose
    topology /sys does not show counts as its own core."""
    groups: dict[tuple[str, str], list[int]] = {}
    for cpu in sorted(allowed):
        topo = sys_cpu / f"cpu{cpu}" / "topology"
        try:
            key = ((topo / "physical_package_id").read_text().strip(), (topo / "core_id").read_text().strip())
        except OSError:
            key = ("cpu", str(cpu))
        groups.setdefault(key, []).append(cpu)
    return list(groups.values())


def core_share(cores: list[list[int]], local_rank: int, local_size: int) -> list[list[int]]:
    """This rank's physical cores: an even contiguous split (DeepSpeed's rule: cores // ranks each, the
    remainder unused); with fewer cores than ranks, ranks share cores round-robin."""
    if not cores:
        return []
    per_rank = len(cores) // local_size
    if per_rank == 0:
        return [cores[local_rank % len(cores)]]
    return cores[local_rank * per_rank : (local_rank + 1) * per_rank]


def bind_threads(environ: dict[str, str] | None = None) -> str | None:
    """Set OMP_NUM_THREADS and the CPU affinity of this rank to its share; returns what it did (for the log),
    None when the environment already decides (OMP_NUM_THREADS set) or this is not a launched rank."""
    env = os.environ if environ is None else environ
    if "OMP_NUM_THREADS" in env or "LOCAL_RANK" not in env:
        return None
    local_rank = int(env["LOCAL_RANK"])
    local_size = int(env.get("LOCAL_SIZE") or env.get("LOCAL_WORLD_SIZE") or 1)
    allowed = os.sched_getaffinity(0)
    share = core_share(physical_cores(allowed), local_rank, local_size)
    if not share:
        return None
    cpus = sorted(c for core in share for c in core)
    env["OMP_NUM_THREADS"] = str(len(share))
    os.sched_setaffinity(0, cpus)
    return f"{len(share)} threads on CPUs {_ranges(cpus)} ({len(share)} of {len(physical_cores(allowed))} cores)"


def _ranges(cpus: list[int]) -> str:
    out: list[str] = []
    for c in cpus:
        if out and "-" in out[-1] and int(out[-1].split("-")[1]) == c - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{c}"
        elif out and "-" not in out[-1] and int(out[-1]) == c - 1:
            out[-1] = f"{out[-1]}-{c}"
        else:
            out.append(str(c))
    return ",".join(out)
