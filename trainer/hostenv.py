"""The rank's process environment, decided on the node before torch loads (no torch import here).

CPU threads: with ZeRO-Offload every GPU rank runs CPU Adam (DeepSpeed's OpenMP op) on its partition.
Unset, OpenMP gives each rank a thread per core, so N ranks put N x cores threads on the cores at once.
Like DeepSpeed's `--bind_cores_to_rank` (deepspeed/utils/numa.py get_numactl_cmd), each local rank gets
its share of the physical cores: OMP_NUM_THREADS = cores in the share, and the process is bound to them.
Unlike it, the cores are the ones this process may use (a container's cpuset, os.sched_getaffinity), grouped
into physical cores from /sys (hyperthread siblings stay together), and numactl is not needed.
A container's CPU quota (cgroup v2 cpu.max, v1 cfs quota) caps the cores shared out: the affinity mask
shows every host CPU while the quota allows a few, and OpenMP threads beyond it only wait for CPU time.
An OMP_NUM_THREADS already in the environment (gpuctl.yaml env, CPU test ranks) wins: nothing is changed;
GPUCTL_BIND_CORES=0 keeps the thread count but leaves placement to the OS (a node shared with other work).

No compiler: the trainer never calls torch.compile, yet modules that decorate with it at import
(DeepSpeed's Muon optimizer, imported by every deepspeed.initialize) pull in Inductor for nothing: 1.5 s of
CPU per rank before the first step. TORCHDYNAMO_DISABLE=1 turns those decorators into no-ops; one already
in the environment (gpuctl.yaml env) wins.

One CPU census: DeepSpeed's op builders ask py-cpuinfo for the CPU's flags at every op load (CPU Adam,
the shared-memory all-reduce), and py-cpuinfo answers each call from a new Python process (1.2 s of CPU
here); the answer cannot change within a rank, so it is kept after the first.

Pinned memory: see trainer.pinning.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

SYS_CPU = Path("/sys/devices/system/cpu")
CGROUP_ROOT = Path("/sys/fs/cgroup")
TORCHRUN_OMP = "GPUCTL_OMP_FROM_TORCHRUN"  # torchrun.sh: no OMP_NUM_THREADS before torchrun, so its "1" is a default
_NODE_CPUS: set[int] = set()  # what the process could use before bind_threads narrowed it


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
    remainder unused); [] when there are fewer cores than ranks (binding would stack ranks on some cores
    while others idle: measured slower than letting the OS spread them, benchmarks/bench_threads.py)."""
    per_rank = len(cores) // local_size
    return cores[local_rank * per_rank : (local_rank + 1) * per_rank]


def cgroup_cpu_limit(root: Path = CGROUP_ROOT) -> float | None:
    """The container's CPU quota in CPUs (Docker --cpus, RunPod's vCPU limit), None when unlimited or unknown.
    cgroup v2: cpu.max "QUOTA PERIOD" or "max PERIOD"; v1: cpu.cfs_quota_us (-1: none) / cpu.cfs_period_us
    under cpu/ or cpu,cpuacct/. A container sees its own cgroup at the root (cgroup namespace)."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        quota = period = ""
        for folder in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
            try:
                quota = (root / folder / "cpu.cfs_quota_us").read_text().strip()
                period = (root / folder / "cpu.cfs_period_us").read_text().strip()
                break
            except OSError:
                continue
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None  # "max", or no cgroup files
    return q / p if q > 0 and p > 0 else None


def no_compiler(environ: dict[str, str] | None = None) -> None:
    """TORCHDYNAMO_DISABLE=1 unless the environment says otherwise (see the module's docstring)."""
    env = os.environ if environ is None else environ
    env.setdefault("TORCHDYNAMO_DISABLE", "1")


def cpu_info_once() -> None:
    """py-cpuinfo's get_cpu_info answers once per process (see the module's docstring)."""
    try:
        import cpuinfo  # DeepSpeed's dependency: it imports it at the first op load anyway
    except ImportError:
        return
    if not hasattr(cpuinfo.get_cpu_info, "cache_info"):
        cpuinfo.get_cpu_info = functools.cache(cpuinfo.get_cpu_info)


def bind_threads(environ: dict[str, str] | None = None, cgroup_root: Path = CGROUP_ROOT) -> str | None:
    """Set OMP_NUM_THREADS and the CPU affinity of this rank to its share; returns what it did (for the log),
    None when the environment already decides (OMP_NUM_THREADS set) or this is not a launched rank. The
    share counts no more cores than the container's CPU quota. With fewer cores than ranks: one thread
    each, not bound. torchrun's own OMP_NUM_THREADS=1 (set whenever it starts several ranks and finds none)
    is not the user's word: torchrun.sh marks it, and it is replaced like an unset one."""
    env = os.environ if environ is None else environ
    if env.get(TORCHRUN_OMP) == "1" and env.get("OMP_NUM_THREADS") == "1":
        del env["OMP_NUM_THREADS"]
    if "OMP_NUM_THREADS" in env or "LOCAL_RANK" not in env:
        return None
    local_rank = int(env["LOCAL_RANK"])
    local_size = int(env.get("LOCAL_SIZE") or env.get("LOCAL_WORLD_SIZE") or 1)
    allowed = os.sched_getaffinity(0)
    cores = physical_cores(allowed)
    limit = cgroup_cpu_limit(cgroup_root)
    quota = ""
    if limit is not None and int(limit) < len(cores):
        cores, quota = cores[: max(1, int(limit))], f"; CPU quota {limit:g}"
    share = core_share(cores, local_rank, local_size)
    if not share:
        env["OMP_NUM_THREADS"] = "1"
        return f"1 thread, not bound ({len(cores)} cores for {local_size} ranks{quota})"
    cpus = sorted(c for core in share for c in core)
    n = len(share)
    env["OMP_NUM_THREADS"] = str(n)
    if env.get("GPUCTL_BIND_CORES", "1") == "0":
        return f"{n} thread{'s' if n > 1 else ''}, not bound (GPUCTL_BIND_CORES=0; {len(cores)} cores{quota})"
    _NODE_CPUS.update(allowed)
    os.sched_setaffinity(0, cpus)
    return f"{n} thread{'s' if n > 1 else ''} on CPUs {_ranges(cpus)} ({n} of {len(cores)} cores{quota})"


@contextmanager
def all_cores() -> Iterator[None]:
    """Work one rank does alone while the others wait (tokenizing the dataset): every core of the node
    for the threads started inside (the tokenizer's pool sizes itself from the affinity), then back."""
    if not _NODE_CPUS:
        yield
        return
    mine = os.sched_getaffinity(0)
    os.sched_setaffinity(0, _NODE_CPUS)
    try:
        yield
    finally:
        os.sched_setaffinity(0, mine)


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


def env_tools_first(environ: dict[str, str] | None = None, executable: str = sys.executable) -> bool:
    """Put this Python environment's bin folder first on PATH when it holds a `ninja`.

    torch JIT-builds DeepSpeed's ops with the first `ninja` on PATH. A rank started over ssh or pdsh
    gets the login PATH, which finds the system's ninja (here 1.11, build log v5) where a local rank
    finds the venv's (pip ninja 1.13, log v7). Each version discards the other's build log and
    rebuilds every op in the shared TORCH_EXTENSIONS_DIR (1-4 minutes of compiling, with every other
    rank waiting on the build lock). One ninja per environment keeps the cache built. Returns
    whether PATH changed."""
    env = os.environ if environ is None else environ
    bin_dir = os.path.dirname(executable)
    if not os.access(os.path.join(bin_dir, "ninja"), os.X_OK):
        return False
    path = env.get("PATH", "").split(os.pathsep)
    if path and path[0] == bin_dir:
        return False
    env["PATH"] = os.pathsep.join([bin_dir, *(p for p in path if p and p != bin_dir)])
    return True


def ops_cache_default(environ: dict[str, str] | None = None, prefix: str = sys.prefix) -> str:
    """Set TORCH_EXTENSIONS_DIR, when unset, to the folder templates/launch.sh.j2 gives a run of this
    Python environment (one per environment, see env_tools_first), so that an op built here (the
    doctor's CPU Adam check) is the one the run loads. Returns the folder."""
    env = os.environ if environ is None else environ
    if not env.get("TORCH_EXTENSIONS_DIR"):
        import hashlib

        key = hashlib.sha256(prefix.encode()).hexdigest()[:12]
        env["TORCH_EXTENSIONS_DIR"] = os.path.expanduser(f"~/.cache/gpuctl/torch_extensions/{key}")
    return env["TORCH_EXTENSIONS_DIR"]
