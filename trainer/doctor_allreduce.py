"""The all-reduce benchmark of `gpuctl doctor`: one process per rank of the node, as a run has them.

Bandwidths as nccl-tests define them (doc/PERFORMANCE.md there): algbw = bytes / time of one
all-reduce; busbw = algbw x 2(n-1)/n, the traffic each link carries in a ring, comparable with
the link's own speed whatever the rank count. NCCL on GPU ranks, gloo on CPU ranks.
"""

from __future__ import annotations

import socket
import time
from typing import Any

WARMUP = 2
ITERS = 5


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def _rank(rank: int, world: int, port: int, accelerator: str, numel: int, out: Any) -> None:
    import torch
    import torch.distributed as dist

    cuda = accelerator == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        tensor = torch.ones(numel, dtype=torch.float32, device=f"cuda:{rank}" if cuda else "cpu")
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
        if rank == 0:
            out.put({"seconds": seconds, "sum_ok": bool(tensor[0].item() == float(world ** (WARMUP + ITERS)))})
    finally:
        dist.destroy_process_group()


def measure(ranks: int, accelerator: str, size_mb: int) -> dict[str, Any]:
    """Time an all-reduce of size_mb MB across `ranks` local processes; algbw/busbw in bytes/s."""
    import torch.multiprocessing as mp

    backend = "nccl" if accelerator == "cuda" else "gloo"
    facts: dict[str, Any] = {"backend": backend, "ranks": ranks, "bytes": size_mb << 20}
    if ranks < 2:
        facts["skipped"] = "one rank: nothing to reduce across"
        return facts
    numel = (size_mb << 20) // 4
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    try:
        mp.start_processes(
            _rank, args=(ranks, _free_port(), accelerator, numel, out), nprocs=ranks, join=True, start_method="spawn"
        )
    except Exception as exc:  # noqa: BLE001 - ProcessRaisedException carries the rank's traceback
        facts["error"] = str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else type(exc).__name__
        return facts
    result = out.get()
    algbw = facts["bytes"] / result["seconds"]
    facts.update(seconds=result["seconds"], sum_ok=result["sum_ok"], algbw=algbw, busbw=algbw * 2 * (ranks - 1) / ranks)
    return facts
