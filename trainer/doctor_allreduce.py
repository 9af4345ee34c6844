"""The all-reduce benchmark of `gpuctl doctor`: one process per rank, as a run has them.

Bandwidths as nccl-tests define them (doc/PERFORMANCE.md there): algbw = bytes / time of one
all-reduce; busbw = algbw x 2(n-1)/n, the traffic each link carries in a ring, comparable with
the link's own speed whatever the rank count. NCCL on GPU ranks, gloo on CPU ranks.

Within a node, `measure` runs the node's ranks on 127.0.0.1. Across nodes, gpuctl starts
`python -m trainer.doctor_allreduce` on every node at once (request on stdin, as trainer.doctor):
each starts its own ranks (global ranks rank_offset..rank_offset+ranks-1) and they meet at the
first node's address, where a run's ranks meet; each prints one JSON line with the result seen by
its local rank 0 and the network interface it reaches the other nodes through.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

WARMUP = 2
ITERS = 5
GROUP_TIMEOUT_S = 120  # a firewalled peer fails the row in minutes, not the process group's 30


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def _rank(local: int, group: dict[str, Any], numel: int, out: Any) -> None:
    import torch
    import torch.distributed as dist

    cuda = group["accelerator"] == "cuda"
    rank, world = group["rank_offset"] + local, group["world"]
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"tcp://{group['master_addr']}:{group['master_port']}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S),
    )
    try:
        tensor = torch.ones(numel, dtype=torch.float32, device=f"cuda:{local}" if cuda else "cpu")
        for _ in range(WARMUP):
            dist.all_reduce(tensor)
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(ITERS):
            dist.all_reduce(tensor)
        if cuda:
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / ITERS
        if local == 0:
            out.put({"seconds": seconds, "sum_ok": bool(tensor[0].item() == float(world ** (WARMUP + ITERS)))})
    finally:
        dist.destroy_process_group()


def _run_group(ranks: int, group: dict[str, Any], size_mb: int) -> dict[str, Any]:
    """This node's `ranks` processes in the group; algbw/busbw (bytes/s) over the whole world."""
    import torch.multiprocessing as mp

    world = group["world"]
    facts: dict[str, Any] = {
        "backend": "nccl" if group["accelerator"] == "cuda" else "gloo",
        "ranks": world,
        "bytes": size_mb << 20,
    }
    if world < 2:
        facts["skipped"] = "one rank: nothing to reduce across"
        return facts
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    try:
        mp.start_processes(
            _rank, args=(group, (size_mb << 20) // 4, out), nprocs=ranks, join=True, start_method="spawn"
        )
    except Exception as exc:  # noqa: BLE001 - ProcessRaisedException carries the rank's traceback
        facts["error"] = str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else type(exc).__name__
        return facts
    result = out.get()
    algbw = facts["bytes"] / result["seconds"]
    facts.update(seconds=result["seconds"], sum_ok=result["sum_ok"], algbw=algbw, busbw=algbw * 2 * (world - 1) / world)
    return facts


def measure(ranks: int, accelerator: str, size_mb: int) -> dict[str, Any]:
    """Time an all-reduce of size_mb MB across `ranks` local processes."""
    group = {"accelerator": accelerator, "world": ranks, "rank_offset": 0}
    return _run_group(ranks, {**group, "master_addr": "127.0.0.1", "master_port": _free_port()}, size_mb)


def link_to(peer: str) -> dict[str, Any]:
    """The interface this node reaches `peer` through and its speed (Mb/s; None where the kernel gives none)."""
    try:
        route = subprocess.run(["ip", "-o", "route", "get", peer], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as exc:
        return {"peer": peer, "error": f"ip route get: {exc}"}
    dev = re.search(r"\bdev (\S+)", route.stdout)
    if not dev:
        return {"peer": peer, "error": (route.stderr.strip() or "no route")[:200]}
    try:  # lo and many virtual NICs have no speed: reading it fails with EINVAL
        speed: int | None = int(Path(f"/sys/class/net/{dev.group(1)}/speed").read_text().strip())
    except (OSError, ValueError):
        speed = None
    return {"peer": peer, "iface": dev.group(1), "speed_mbps": speed if speed and speed > 0 else None}


def main() -> None:
    """Across nodes: {"env", "ranks", "rank_offset", "world", "master_addr", "master_port", "peer",
    "accelerator", "allreduce_mb"} on stdin -> {"allreduce": {...}, "link": {...}} on stdout."""
    request = json.loads(sys.stdin.read() or "{}")
    os.environ.update({k: str(v) for k, v in (request.get("env") or {}).items()})
    group = {k: request[k] for k in ("rank_offset", "world", "master_addr", "master_port")}
    group["accelerator"] = request.get("accelerator", "cpu")
    facts = {
        "link": link_to(str(request["peer"])),
        "allreduce": _run_group(int(request["ranks"]), group, int(request.get("allreduce_mb") or 32)),
    }
    sys.stdout.write(json.dumps(facts) + "\n")


if __name__ == "__main__":
    main()
