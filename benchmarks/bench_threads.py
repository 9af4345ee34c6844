#!/usr/bin/env python
"""CPU Adam with N ranks on one node: every rank on every core (OpenMP's default) vs each rank on its share.

With ZeRO-Offload every GPU rank runs DeepSpeed's CPU Adam (an OpenMP op) on its partition at the same
moment. Unset, OpenMP starts one thread per CPU in every rank, so N ranks put N x cores threads on the
cores. gpuctl's trainer gives each rank its share of the physical cores and binds it there
(trainer/hostenv.py, the same rule as DeepSpeed's --bind_cores_to_rank without numactl). This starts N
processes that step DeepSpeedCPUAdam on --params elements each, together, in three modes, and prints the
time of a step (the slowest rank's, as the ranks wait for each other) side by side:

  all-cores  OMP_NUM_THREADS unset, no binding (what a GPU rank had before issue 21)
  share      trainer.hostenv.bind_threads(): cores // ranks threads each, bound to those cores (fewer cores
             than ranks: one thread each, not bound)
  one        OMP_NUM_THREADS=1, no binding (what gpuctl's CPU test ranks use)

    python benchmarks/bench_threads.py --ranks 3 --params 20000000 --steps 8
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODES = ("all-cores", "share", "one")


def rank_main(mode: str, rank: int, ranks: int, params: int, steps: int, barrier, out) -> None:
    os.environ.pop("OMP_NUM_THREADS", None)
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_SIZE=str(ranks), DS_ACCELERATOR="cpu")
    sys.path.insert(0, str(REPO))
    note = ""
    if mode == "share":
        from trainer import hostenv

        note = hostenv.bind_threads() or ""
    elif mode == "one":
        os.environ["OMP_NUM_THREADS"] = "1"
    import torch  # after the env: OpenMP reads OMP_NUM_THREADS when it loads
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    torch.manual_seed(rank)
    weight = torch.nn.Parameter(torch.randn(params))
    weight.grad = torch.randn(params)
    opt = DeepSpeedCPUAdam([weight], lr=1e-3)
    opt.step()  # warm-up: states allocated, pages touched
    times = []
    for _ in range(steps):
        barrier.wait()  # ranks step together, as ZeRO-Offload's ranks do
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    out.put((rank, times, note, os.environ.get("OMP_NUM_THREADS", "unset")))


def run_mode(mode: str, ranks: int, params: int, steps: int) -> dict:
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(ranks), ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(mode, r, ranks, params, steps, barrier, out)) for r in range(ranks)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join()
    per_step = [max(r[1][i] for r in results) for i in range(steps)]  # the slowest rank sets the pace
    return {
        "mode": mode,
        "ranks": ranks,
        "step_s_median": statistics.median(per_step),
        "step_s_mean": statistics.fmean(per_step),
        "params_per_s": ranks * params / statistics.median(per_step),
        "threads": [r[3] for r in results],
        "binding": [r[2] for r in results],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=3)
    p.add_argument("--params", type=int, default=20_000_000, help="elements of each rank's partition")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    cpus = len(os.sched_getaffinity(0))
    print(
        f"bench_threads: {args.ranks} ranks x {args.params / 1e6:g}M params CPU Adam, {cpus} CPUs, {args.steps} steps"
    )
    rows = [run_mode(mode, args.ranks, args.params, args.steps) for mode in MODES]
    base = rows[0]["step_s_median"]
    for row in rows:
        print(
            f"  {row['mode']:10s} step {row['step_s_median'] * 1e3:8.1f} ms (mean {row['step_s_mean'] * 1e3:7.1f})  "
            f"{row['params_per_s'] / 1e6:7.1f} M params/s  x{base / row['step_s_median']:.2f} vs all-cores  "
            f"OMP {','.join(row['threads'])}  {'; '.join(b for b in row['binding'] if b)}"
        )
    if args.json:
        args.json.write_text(json.dumps({"cpus": cpus, **vars(args), "json": None, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
