"""Trainer overhead benchmark: gpuctl's trainer vs a bare DeepSpeed loop, same model/config/ranks.

    python benchmarks/bench_trainer.py [--ranks 3] [--steps 20] [--rounds 2] [--precision fp32]

Both runs use the tiny DeepSeek-shaped model, the same ds_config (ZeRO-2, CPU offload,
micro 1 x grad_accum 4), the same launcher and rank count. Tokens/s excludes each run's
first (warm-up) step in both. The bare loop (below, --bare) feeds random tokens and does
nothing but forward/backward/step. Goal: trainer / bare >= 0.95. Rounds alternate
trainer and bare so drift in the machine's load hits both alike; the best round of each counts.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))


def bare_loop(steps: int, seq_len: int) -> None:
    """Run as a DeepSpeed user script on every rank: the minimal training loop."""
    import deepspeed
    import torch
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainer.model import TINY_SHAPE

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(1234)
    vocab = 259
    model = LlamaForCausalLM._from_config(LlamaConfig(vocab_size=vocab, use_cache=False, **TINY_SHAPE),
                                          attn_implementation="sdpa")
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config="ds_config.json")
    micro, accum = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    tokens_per_step = engine.train_batch_size() * seq_len
    timed, seconds = 0, 0.0
    for step in range(steps):
        started = time.perf_counter()
        for _ in range(accum):
            block = torch.randint(0, vocab, (micro, seq_len + 1))
            logits = engine(input_ids=block[:, :-1]).logits
            loss = F.cross_entropy(logits.float().reshape(-1, vocab), block[:, 1:].reshape(-1))
            engine.backward(loss)
            engine.step()
        if step > 0:
            if os.environ.get("BENCH_VERBOSE"):
                print(f"bare step {step} {time.perf_counter() - started:.3f}s", flush=True)
            timed, seconds = timed + tokens_per_step, seconds + time.perf_counter() - started
    if torch.distributed.get_rank() == 0:
        print("BARE " + json.dumps({"tokens_per_s": timed / seconds}), flush=True)


def run_trainer(root: Path, ranks: int, steps: int, seq_len: int, precision: str) -> float:
    import test_trainer_helpers as h

    run = h.make_run_dir(root / f"trainer-{time.monotonic_ns()}", world=ranks, grad_accum=4, precision=precision,
                         max_steps=steps, seq_len=seq_len, checkpoint_every=0, log_every=1)
    proc = h.launch(run, ranks, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"trainer failed:\n{proc.stdout[-3000:]}")
    return h.summary(run)["tokens_per_s"]


def run_bare(root: Path, ranks: int, steps: int, seq_len: int, precision: str) -> float:
    import subprocess

    import test_trainer_helpers as h

    run = h.make_run_dir(root / f"bare-{time.monotonic_ns()}", world=ranks, grad_accum=4, precision=precision,
                         max_steps=steps, seq_len=seq_len)
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(ranks), "--no_local_rank",
           "--master_port", str(h.free_port()), str(Path(__file__).resolve()), "--bare", "--steps", str(steps),
           "--seq-len", str(seq_len)]
    proc = subprocess.run(cmd, cwd=run, env=h.rank_env(), capture_output=True, text=True, timeout=900, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("BARE ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"bare loop failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return json.loads(lines[0][5:])["tokens_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--bare", action="store_true", help="internal: run the bare loop as a rank")
    args = parser.parse_args()
    if args.bare:
        bare_loop(args.steps, args.seq_len)
        return
    results: dict[str, list[float]] = {"trainer": [], "bare": []}
    with tempfile.TemporaryDirectory(prefix="bench-trainer-") as tmp:
        for n in range(args.rounds):
            for name, fn in (("trainer", run_trainer), ("bare", run_bare)):
                rate = fn(Path(tmp), args.ranks, args.steps, args.seq_len, args.precision)
                results[name].append(rate)
                print(f"round {n + 1}: {name:7s} {rate:8.0f} tokens/s", flush=True)
    best = {name: max(rates) for name, rates in results.items()}
    ratio = best["trainer"] / best["bare"]
    print(json.dumps({"ranks": args.ranks, "steps": args.steps, "seq_len": args.seq_len, "precision": args.precision,
                      "trainer_tokens_per_s": round(best["trainer"], 1), "bare_tokens_per_s": round(best["bare"], 1),
                      "ratio": round(ratio, 3),
                      "median_ratio": round(statistics.median(results["trainer"]) / statistics.median(results["bare"]), 3),
                      "goal": ">= 0.95"}))


if __name__ == "__main__":
    main()
