"""Trainer overhead benchmark: gpuctl's trainer vs a bare DeepSpeed loop, same model/config/ranks.

    python benchmarks/bench_trainer.py [--ranks 3] [--steps 20] [--rounds 2] [--precision fp32]

Two measurements, both with the tiny DeepSeek-shaped model, the same ds_config (ZeRO-2, CPU
offload, micro 1 x grad_accum 4), the same launcher and rank count; tokens/s leaves out the
first (warm-up) step:

1. end to end: `python -m trainer` vs a minimal loop (below, --bare: random tokens, nothing but
   forward/backward/step), separate launches, alternating, `--rounds` times. On a shared,
   busy machine these swing with the load of other processes.
2. interleaved (--interleaved, one launch): the same ranks and the same engine alternate one
   trainer step (trainer.loop.step_and_log: data order, loss gather, metrics, logging) with
   one bare step, so load drift hits both alike. This isolates the trainer's per-step overhead.

Goal: trainer / bare >= 0.95.
"""

from __future__ import annotations

import argparse
import json
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
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainer.model import TINY_SHAPE

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(1234)
    vocab = 259
    model = LlamaForCausalLM._from_config(
        LlamaConfig(vocab_size=vocab, use_cache=False, **TINY_SHAPE), attn_implementation="sdpa"
    )
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config="ds_config.json")
    tokens_per_step = engine.train_batch_size() * seq_len
    timed, seconds = 0, 0.0
    for step in range(steps):
        started = time.perf_counter()
        bare_step(engine, vocab, seq_len)
        if step > 0:
            timed, seconds = timed + tokens_per_step, seconds + time.perf_counter() - started
    if torch.distributed.get_rank() == 0:
        print("BARE " + json.dumps({"tokens_per_s": timed / seconds}), flush=True)


def bare_step(engine, vocab: int, seq_len: int) -> None:
    import torch
    import torch.nn.functional as F

    for _ in range(engine.gradient_accumulation_steps()):
        block = torch.randint(0, vocab, (engine.train_micro_batch_size_per_gpu(), seq_len + 1))
        logits = engine(input_ids=block[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, vocab), block[:, 1:].reshape(-1))
        engine.backward(loss)
        engine.step()


def interleaved_loop(steps: int) -> None:
    """Run as a DeepSpeed user script in a trainer run dir: alternate trainer and bare steps."""
    import torch.distributed as dist

    from trainer import loop
    from trainer.checkpoint import Position
    from trainer.config import DistEnv, load_run_config
    from trainer.dataset import Sampler
    from trainer.metrics import MetricsLog

    cfg = load_run_config(Path("run.json"))
    env = DistEnv.from_env()
    run = loop.setup(cfg, env)
    sampler, stats, pos = Sampler(run.data.num_samples, cfg.train.seed), loop.RunStats(), Position()
    metrics = MetricsLog(cfg.run_dir, cfg.train.max_steps) if env.is_main else None
    vocab = run.engine.module.config.vocab_size
    seconds = {"trainer": 0.0, "bare": 0.0}
    run.engine.train()
    for step in range(steps):
        order = ("trainer", "bare") if step % 2 == 0 else ("bare", "trainer")
        for name in order:
            dist.barrier()  # start in step, and charge each kind its own stragglers (the barrier after)
            started = time.perf_counter()
            if name == "trainer":
                pos = loop.step_and_log(run, sampler, pos, stats, metrics)
            else:
                bare_step(run.engine, vocab, cfg.train.seq_len)
            dist.barrier()
            if step > 0:
                seconds[name] += time.perf_counter() - started
    if env.is_main:
        tokens = (steps - 1) * run.geo.tokens_per_step
        print("INTERLEAVED " + json.dumps({name: tokens / s for name, s in seconds.items()}), flush=True)


def make_run(root: Path, name: str, args: argparse.Namespace) -> Path:
    import test_trainer_helpers as h

    return h.make_run_dir(
        root / f"{name}-{time.monotonic_ns()}",
        world=args.ranks,
        grad_accum=4,
        precision=args.precision,
        max_steps=args.steps,
        seq_len=args.seq_len,
        checkpoint_every=0,
        log_every=1,
    )


def run_trainer(root: Path, args: argparse.Namespace) -> float:
    import test_trainer_helpers as h

    run = make_run(root, "trainer", args)
    proc = h.launch(run, args.ranks, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"trainer failed:\n{proc.stdout[-3000:]}")
    return h.summary(run)["tokens_per_s"]


def run_script(root: Path, args: argparse.Namespace, mode: str) -> dict:
    """Launch this file as the ranks' script in --bare or --interleaved mode; rank 0's JSON line."""
    import subprocess

    import test_trainer_helpers as h

    run = make_run(root, mode, args)
    cmd = [
        sys.executable,
        "-m",
        "deepspeed.launcher.runner",
        "--num_gpus",
        str(args.ranks),
        "--no_local_rank",
        "--master_port",
        str(h.free_port()),
        str(Path(__file__).resolve()),
        f"--{mode}",
        "--steps",
        str(args.steps),
        "--seq-len",
        str(args.seq_len),
    ]
    proc = subprocess.run(cmd, cwd=run, env=h.rank_env(), capture_output=True, text=True, timeout=900, check=False)
    marker = f"{mode.upper()} "
    lines = [line for line in proc.stdout.splitlines() if line.startswith(marker)]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{mode} run failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return json.loads(lines[0][len(marker) :])


def end_to_end(root: Path, args: argparse.Namespace) -> dict:
    results: dict[str, list[float]] = {"trainer": [], "bare": []}
    for n in range(args.rounds):
        for name in ("trainer", "bare"):
            rate = run_trainer(root, args) if name == "trainer" else run_script(root, args, "bare")["tokens_per_s"]
            results[name].append(rate)
            print(f"end-to-end round {n + 1}: {name:7s} {rate:8.0f} tokens/s", flush=True)
    median = {name: statistics.median(rates) for name, rates in results.items()}
    return {
        "trainer_median": round(median["trainer"], 1),
        "bare_median": round(median["bare"], 1),
        "ratio_of_medians": round(median["trainer"] / median["bare"], 3),
        "rounds": {name: [round(r) for r in rates] for name, rates in results.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2, help="end-to-end rounds (0: interleaved only)")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--bare", action="store_true", help="internal: run the bare loop as a rank")
    parser.add_argument("--interleaved", action="store_true", help="internal: run the interleaved loop as a rank")
    args = parser.parse_args()
    if args.bare:
        bare_loop(args.steps, args.seq_len)
        return
    if args.interleaved:
        interleaved_loop(args.steps)
        return
    report = {
        "ranks": args.ranks,
        "steps": args.steps,
        "seq_len": args.seq_len,
        "precision": args.precision,
        "goal": "trainer / bare >= 0.95",
    }
    with tempfile.TemporaryDirectory(prefix="bench-trainer-") as tmp:
        rates = run_script(Path(tmp), args, "interleaved")
        print(f"interleaved: trainer {rates['trainer']:.0f} tokens/s, bare {rates['bare']:.0f} tokens/s", flush=True)
        report["interleaved"] = {
            "trainer": round(rates["trainer"], 1),
            "bare": round(rates["bare"], 1),
            "ratio": round(rates["trainer"] / rates["bare"], 3),
        }
        if args.rounds:
            report["end_to_end"] = end_to_end(Path(tmp), args)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
