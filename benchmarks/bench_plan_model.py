"""Does plan's step-time model, calibrated by the doctor on this machine, predict the local run's step?

    python benchmarks/bench_plan_model.py [--steps 12] [--ranks 3] [--configs 128x1,512x4]

Per config (seq_len x grad_accum; the tiny model, ZeRO-2 + CPU offload, fp32, micro_batch 1, CPU ranks):
1. the doctor's node side (`python -m trainer.doctor`, the full request `gpuctl doctor` sends, built by
   provision.flows.doctor.rates_request) measures the rates on this machine;
2. plan's model (provision.estimate.step_time.predict) turns them into a step time, term by term;
3. the trainer runs the same config (`python -m trainer` under DeepSpeed's launcher, as the node runs it)
   and metrics.jsonl gives the measured mean step (steps after the first), forward+backward, optimizer step.
The bar (issue 32): measured step within 25% of the prediction, and the predicted range no wider than 1.6x.
The save is compared on its own (the trainer saves after a step, outside step_time_s).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))


def doctor_facts(workdir: Path, ranks: int, seq_len: int, grad_accum: int) -> dict:
    """The doctor's node side on this machine, with the request `gpuctl doctor` sends for this config."""
    import test_trainer_helpers as h

    from provision.core.config import TrainConfig
    from provision.flows.doctor import ALLREDUCE_MB, DISK_MB, rates_request

    train = TrainConfig(model="tiny", seq_len=seq_len, grad_accum=grad_accum, micro_batch=1, precision="fp32")
    env = h.rank_env()
    request = {
        "quick": False,
        "ranks": ranks,
        "accelerator": "cpu",
        "workdir": str(workdir),
        "offload": True,
        "env": {k: env[k] for k in ("DS_ACCELERATOR", "OMP_NUM_THREADS", "TORCH_EXTENSIONS_DIR")},
        "allreduce_mb": ALLREDUCE_MB,
        "disk_mb": DISK_MB[False],
        "rates": rates_request(train, ranks),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "trainer.doctor"],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        check=False,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"doctor failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def predicted(facts: dict, ranks: int, seq_len: int, grad_accum: int, max_steps: int):
    from provision.estimate.doctor_speed import raw_rates
    from provision.estimate.plan import plan
    from provision.estimate.plan_input import PlanInput
    from provision.estimate.step_time import predict

    result = plan(
        PlanInput(
            model="tiny",
            gpus_per_node=ranks,
            micro_batch=1,
            seq_len=seq_len,
            grad_accum=grad_accum,
            precision="fp32",
            gradient_checkpointing=False,
        )
    )
    return predict(result, accelerator="cpu", doctor={"local": raw_rates(facts)}, checkpoint_every=max_steps)


def measured_run(root: Path, ranks: int, seq_len: int, grad_accum: int, steps: int) -> dict:
    import test_trainer_helpers as h

    from provision.estimate.forecast import measured_means

    run = h.make_run_dir(
        root / f"run-{seq_len}x{grad_accum}-{time.monotonic_ns()}",
        world=ranks,
        grad_accum=grad_accum,
        seq_len=seq_len,
        max_steps=steps,
        checkpoint_every=steps,
        log_every=1,
    )
    proc = h.launch(run, ranks, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"trainer failed:\n{proc.stdout[-3000:]}")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return measured_means(records, h.summary(run).get("save_s"))


def one_config(root: Path, args: argparse.Namespace, seq_len: int, grad_accum: int) -> dict:
    from provision.estimate.forecast import compare
    from provision.estimate.step_time import model_to_json

    facts = doctor_facts(root, args.ranks, seq_len, grad_accum)
    model = predicted(facts, args.ranks, seq_len, grad_accum, args.steps)
    seen = measured_run(root, args.ranks, seq_len, grad_accum, args.steps)
    save = next(t for t in model.terms if t.name == "checkpoint")
    step_mid = model.step_s - save.seconds  # the save happens after a step, outside step_time_s
    fast, slow = model.fast_s - save.fast_s, model.slow_s - save.slow_s
    print(f"\n== seq {seq_len} x grad_accum {grad_accum}, {args.ranks} CPU ranks ==", flush=True)
    for t in model.terms:
        print(f"  {t.name:16s} {t.seconds * 1e3:9.2f} ms  ({t.fast_s * 1e3:.2f}-{t.slow_s * 1e3:.2f})  {t.rate.source}")
    rows = compare(model_to_json(model), seen)
    for part, pred, got in rows:
        got_s = f"{got * 1e3:9.2f} ms" if got is not None else "        -"
        print(f"  {part:26s} predicted {pred * 1e3:9.2f} ms   measured {got_s}")
    step = seen["step_time_s"]
    error = step / step_mid - 1
    out = {
        "seq_len": seq_len,
        "grad_accum": grad_accum,
        "predicted_step_s": round(step_mid, 5),
        "predicted_range_s": [round(fast, 5), round(slow, 5)],
        "range_ratio": round(slow / fast, 3),
        "measured_step_s": round(step, 5),
        "error": round(error, 3),
        "within_25pct": abs(error) <= 0.25,
        "bound": max((t for t in model.terms if t.name != "checkpoint"), key=lambda t: t.seconds).name,
        "parts": {part: {"predicted": round(p, 5), "measured": g if g is None else round(g, 5)} for part, p, g in rows},
    }
    print(
        f"  step: predicted {step_mid * 1e3:.1f} ms ({fast * 1e3:.1f}-{slow * 1e3:.1f}, {slow / fast:.2f}x), "
        f"measured {step * 1e3:.1f} ms, error {error:+.1%}, bound {out['bound']}",
        flush=True,
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--configs", default="128x1,512x4", help="seq_len x grad_accum, comma separated")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-plan-model-") as tmp:
        for item in args.configs.split(","):
            seq, accum = (int(x) for x in item.split("x"))
            results.append(one_config(Path(tmp), args, seq, accum))
    ok = all(r["within_25pct"] and r["range_ratio"] <= 1.6 for r in results)
    print(json.dumps({"ranks": args.ranks, "steps": args.steps, "configs": results, "bar_met": ok}))


if __name__ == "__main__":
    main()
