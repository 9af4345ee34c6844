"""`gpuctl doctor`, node side: measure what this node has, print one JSON object of facts.

`python -m trainer.doctor` reads its request as JSON on stdin (so the storage credentials travel
on no command line and in no file) and prints the facts as one JSON line on stdout. It judges
nothing: the laptop (provision/estimate/doctor.py) holds the expectations and the fixes, and
parses nvidia-smi's output itself, so the rules are tested without a GPU or torch.

Request: {"quick": bool, "ranks": int, "accelerator": "cpu"|"cuda", "workdir": str,
"offload": bool, "storage": {CheckpointStore settings} | null, "storage_env": {AWS_*},
"env": {gpuctl.yaml env}, "allreduce_mb": int, "storage_mb": int, "disk_mb": int,
"rates": {trainer.doctor_rates.measure's request} | null}.
Quick mode (what `up` runs, seconds): host, GPUs, versions, a small storage round trip, the disk's
write rate. The full run adds the all-reduce benchmark (trainer.doctor_allreduce), loading CPU Adam,
the storage throughput of a larger object and the step-time model's rates (trainer.doctor_rates).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SMI_TIMEOUT_S = 30
SMI_MAX_BYTES = 8 << 20  # an nvidia-smi XML of 8 GPUs is ~600 KB; more is not nvidia-smi's
SHM_ENV = "GPUCTL_SHM_DIR"  # where the ranks' shared memory lives (default /dev/shm)
XID_MARK = "NVRM: Xid"  # how the NVIDIA driver prefixes a GPU fault in the kernel log
MAX_XID_LINES = 200  # the newest ones; a flapping GPU can log thousands


def _meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            name, _, rest = line.partition(":")
            if rest.strip().endswith("kB"):
                out[name] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


def _existing(path: str) -> str:
    """path, or its nearest existing parent (a workdir `up` has not made yet)."""
    p = Path(path or "/").expanduser()
    while not p.exists() and p != p.parent:
        p = p.parent
    return str(p)


def _fs(path: str) -> dict[str, Any]:
    where = _existing(path)
    st = os.statvfs(where)
    return {"path": path, "measured_at": where, "total": st.f_frsize * st.f_blocks, "free": st.f_frsize * st.f_bavail}


def host_facts(workdir: str) -> dict[str, Any]:
    from trainer.hostenv import physical_cores

    mem = _meminfo()
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    return {
        "time": time.time(),
        "mem_total": mem.get("MemTotal"),
        "mem_available": mem.get("MemAvailable"),
        "shm": _fs(os.environ.get(SHM_ENV) or "/dev/shm"),
        "disk": _fs(workdir),
        "cpus": len(allowed),
        "physical_cores": len(physical_cores(set(allowed))),
    }


def _run(argv: list[str]) -> dict[str, Any]:
    """An nvidia-smi call: its bounded stdout, or the error in one line."""
    try:
        out = subprocess.run(argv, capture_output=True, timeout=SMI_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as exc:
        return {"error": f"{argv[0]}: {exc}"}
    if out.returncode != 0:
        return {
            "error": (out.stderr or out.stdout).decode("utf-8", "replace").strip()[-300:] or f"exit {out.returncode}"
        }
    if len(out.stdout) > SMI_MAX_BYTES:
        return {"error": f"{len(out.stdout)} bytes of output: more than nvidia-smi writes"}
    return {"text": out.stdout.decode("utf-8", "replace")}


def kernel_xids() -> dict[str, Any]:
    """The driver's `NVRM: Xid` lines since boot: dmesg, else journalctl -k. Unprivileged containers
    often may read neither (kernel.dmesg_restrict, no journal): then the error says so."""
    errors = []
    for argv in (["dmesg"], ["journalctl", "-k", "-b", "--no-pager", "-q"]):
        if not shutil.which(argv[0]):
            errors.append(f"{argv[0]}: not installed")
            continue
        try:
            out = subprocess.run(argv, capture_output=True, timeout=SMI_TIMEOUT_S)
        except (OSError, subprocess.SubprocessError) as exc:
            errors.append(f"{argv[0]}: {exc}")
            continue
        text = out.stdout.decode("utf-8", "replace")
        if out.returncode != 0 or not text.strip():  # an empty kernel log is one we may not read
            why = out.stderr.decode("utf-8", "replace").strip().splitlines()
            errors.append(f"{argv[0]}: {why[-1][:150] if why else f'exit {out.returncode}, no output'}")
            continue
        lines = [line for line in text.splitlines() if XID_MARK in line]
        return {"source": argv[0], "lines": lines[-MAX_XID_LINES:], "count": len(lines)}
    return {"error": "; ".join(errors)}


def gpu_facts(accelerator: str) -> dict[str, Any]:
    if not shutil.which("nvidia-smi"):
        return {"present": False}
    facts: dict[str, Any] = {"present": True, "query": _run(["nvidia-smi", "-q", "-x"])}
    if accelerator == "cuda":
        facts["topo"] = _run(["nvidia-smi", "topo", "-m"])
        facts["xid"] = kernel_xids()
    return facts


def _installed(name: str) -> dict[str, Any]:
    """A package's version from its metadata, without importing it (quick mode: no seconds of import)."""
    from importlib import metadata

    try:
        return {name: metadata.version(name)}
    except metadata.PackageNotFoundError:
        return {f"{name}_error": f"{name} is not installed for {sys.executable}"}


def _torch_cuda_from_files() -> str | None:
    """torch's CUDA build from torch/version.py, read as text (importing torch takes seconds)."""
    import importlib.util
    import re

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.origin:
        return None
    try:
        text = (Path(spec.origin).parent / "version.py").read_text()
    except OSError:
        return None
    found = re.search(r"^cuda(?::[^=]*)?=\s*['\"]([\d.]+)['\"]", text, re.M)
    return found.group(1) if found else None


def software_facts(quick: bool, load_cpu_adam: bool) -> dict[str, Any]:
    facts: dict[str, Any] = {"python": sys.version.split()[0]}
    if quick:
        facts.update(_installed("torch"), **_installed("deepspeed"))
        facts["torch_cuda"] = _torch_cuda_from_files()
        return facts
    try:
        import torch

        facts["torch"] = torch.__version__
        facts["torch_cuda"] = torch.version.cuda
        facts["cuda_available"] = bool(torch.cuda.is_available())
    except ImportError as exc:
        facts["torch_error"] = str(exc)
        return facts
    try:
        import deepspeed

        facts["deepspeed"] = deepspeed.__version__
    except Exception as exc:  # noqa: BLE001 - DeepSpeed's import raises what its accelerator probe meets
        facts["deepspeed_error"] = f"{type(exc).__name__}: {exc}"[:300]
        return facts
    if load_cpu_adam:
        facts["cpu_adam"] = _load_cpu_adam()
    return facts


def _load_cpu_adam() -> dict[str, Any]:
    """Build (first time, into TORCH_EXTENSIONS_DIR) and load DeepSpeed's CPU Adam op, as a run would."""
    from deepspeed.accelerator import get_accelerator

    from trainer.hostenv import env_tools_first, ops_cache_default

    env_tools_first()  # the ninja and the cache folder a run's ranks use: one build serves both
    ops_cache_default()
    start = time.monotonic()
    try:
        get_accelerator().create_op_builder("CPUAdamBuilder").load(verbose=False)
    except Exception as exc:  # noqa: BLE001 - a compiler error, a missing header: the row shows it
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[-300:], "seconds": time.monotonic() - start}
    return {"ok": True, "seconds": time.monotonic() - start, "cache": os.environ.get("TORCH_EXTENSIONS_DIR")}


def storage_facts(settings: dict[str, Any], env: dict[str, str], large_mb: int) -> dict[str, Any]:
    """Put, get and delete a small object with the run's own credentials; with large_mb, time a larger one."""
    os.environ.update(env)
    from trainer.objstore.backends import StorageError
    from trainer.objstore.store import CheckpointStore

    facts: dict[str, Any] = {}
    key = f".gpuctl-doctor-{secrets.token_hex(4)}"
    try:
        backend = CheckpointStore.from_config(settings).backend
        facts["url"] = backend.url
        small = secrets.token_bytes(1024)
        backend.write_bytes(key, small)
        facts["roundtrip"] = backend.read_bytes(key) == small
        if large_mb:
            big = secrets.token_bytes(large_mb << 20)
            t0, cpu0 = time.monotonic(), time.process_time()  # every thread of this process: boto3's too
            backend.write_bytes(key, big)
            t1, put_cpu_s = time.monotonic(), time.process_time() - cpu0
            same = backend.read_bytes(key) == big
            t2 = time.monotonic()
            facts.update(large_mb=large_mb, put_s=t1 - t0, get_s=t2 - t1, large_ok=same, put_cpu_s=put_cpu_s)
        backend.delete([key])
        facts["deleted"] = backend.read_bytes(key) is None
    except (StorageError, ValueError, OSError) as exc:
        facts["error"] = f"{type(exc).__name__}: {exc}"[:400]
    return facts


def main() -> None:
    request = json.loads(sys.stdin.read() or "{}")
    os.environ.update({k: str(v) for k, v in (request.get("env") or {}).items()})
    quick = bool(request.get("quick"))
    accelerator = request.get("accelerator", "cpu")
    facts: dict[str, Any] = {"host": host_facts(request.get("workdir") or "~")}
    facts["gpu"] = gpu_facts(accelerator)
    facts["software"] = software_facts(quick, load_cpu_adam=not quick and bool(request.get("offload")))
    if request.get("storage"):
        large = 0 if quick else int(request.get("storage_mb") or 0)
        facts["storage"] = storage_facts(request["storage"], request.get("storage_env") or {}, large)
    from trainer.doctor_rates import disk_write

    facts["rates"] = {"disk": disk_write(request.get("workdir") or "~", int(request.get("disk_mb") or 64))}
    stored = facts.get("storage") or {}
    if stored.get("large_ok") and stored.get("put_cpu_s"):  # what uploading costs this node's CPU (plan's term)
        facts["rates"]["upload"] = {"bytes": stored["large_mb"] << 20, "cpu_s": stored["put_cpu_s"]}
    if not quick and "torch" in facts["software"]:
        from trainer.doctor_allreduce import measure

        facts["allreduce"] = measure(
            int(request.get("ranks") or 1), accelerator, int(request.get("allreduce_mb") or 32)
        )
        if isinstance(request.get("rates"), dict) and facts["software"].get("deepspeed"):
            from trainer import doctor_rates

            facts["rates"].update(
                doctor_rates.measure(
                    {**request["rates"], "ranks": request.get("ranks") or 1, "accelerator": accelerator}
                )
            )
    sys.stdout.write(json.dumps(facts) + "\n")


if __name__ == "__main__":
    main()
