"""Training speed with checkpoints uploading in the background vs without (goal: >= 0.9x).

    .venv/bin/python benchmarks/bench_train_upload.py                      # 2 ranks, 40 steps, moto
    .venv/bin/python benchmarks/bench_train_upload.py --ranks 3 --repeats 3 --server rclone --json out.json

Runs the real trainer (tiny model, DeepSpeed ZeRO-2 on CPU ranks over gloo, the launch
command the node runs) twice per repeat, alternating:
  - off: no storage; checkpoints are still saved to local disk every --every steps;
  - on:  storage s3://bucket/... on an S3 server on loopback: each saved checkpoint is also
         hashed and uploaded by the BackgroundUploader thread in local rank 0 while the next
         steps train.
Both save the same checkpoints, so the difference is what the upload costs training.
The S3 server stands in for a remote one: it runs at --server-nice (default 19), so it gets the
cores only when the ranks leave them idle (pass 0 to let it compete as an equal).
Reported: steady tokens/s (summary.json: steps after the first, training time only, no save
time), wall tokens/s (first to last step, saves included), and for `on` the fraction of that
wall time the uploader was busy (from its "upload done ... in X s" lines), how many saves were
superseded (skipped because uploads were slower than saves), and the machine's 1-minute load
after each run (on a shared box the ratio means little when the load is far above the cores).
Only 127.0.0.1 is contacted.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import test_trainer_helpers as helpers  # noqa: E402

from tests.s3server import TEST_KEY_ID, TEST_SECRET, MotoS3, RcloneS3  # noqa: E402

UPLOAD_DONE = re.compile(r"upload done(?: and published)? in ([0-9.]+) s")


def one_run(work: Path, name: str, args, storage: dict | None) -> dict:
    run_dir = helpers.make_run_dir(
        work / name,
        world=args.ranks,
        grad_accum=args.grad_accum,
        max_steps=args.steps,
        checkpoint_every=args.every,
        seq_len=args.seq_len,
        keep_local=2,
        storage=storage,
    )
    for attempt in range(3):
        t0 = time.perf_counter()
        proc = helpers.launch(run_dir, args.ranks, timeout=1800)
        wall = time.perf_counter() - t0
        # On a shared test box, another run's multi-node stop (DeepSpeed's pdsh `pkill -f` of every
        # `python -u -m deepspeed.launcher.launch` on its nodes, here: this machine) kills ours too.
        if proc.returncode == 0 or "Main process received SIGTERM" not in proc.stdout:
            break
        print(f"{name}: the launcher was killed from outside (attempt {attempt + 1}); running it again", flush=True)
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
        for stale in ("metrics.jsonl", "summary.json"):
            (run_dir / stale).unlink(missing_ok=True)
        if storage:
            storage["url"] += f"-retry{attempt + 1}"
            (run_dir / "run.json").write_text(
                json.dumps({**json.loads((run_dir / "run.json").read_text()), "storage": storage}, indent=2)
            )
    if proc.returncode != 0:
        raise SystemExit(f"{name}: trainer failed ({proc.returncode}):\n{proc.stdout[-3000:]}")
    summary = helpers.summary(run_dir)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    first, last = metrics[0], metrics[-1]
    span = last["time"] - first["time"]  # from the end of step 1 to the end of the last step
    upload_s = sum(float(m) for m in UPLOAD_DONE.findall(proc.stdout))
    ckpt_mb = (
        sum(p.stat().st_size for p in (run_dir / "checkpoints" / f"step{args.steps}").rglob("*") if p.is_file()) / 1e6
    )
    return {
        "steady_tokens_per_s": summary["tokens_per_s"],
        "wall_tokens_per_s": (last["tokens"] - first["tokens"]) / span,
        "upload_busy": upload_s / span if storage else 0.0,
        "uploads": len(UPLOAD_DONE.findall(proc.stdout)),
        "superseded": proc.stdout.count("upload skipped, superseded by"),  # saves faster than uploads: coalesced
        "load_1min": os.getloadavg()[0],
        "checkpoint_mb": ckpt_mb,
        "process_s": wall,
    }


def renice(pid: int, nice: int) -> None:
    """Every thread of pid (threads started later inherit from the thread that starts them), and
    its session's autogroup: with kernel.sched_autogroup_enabled, CPU is shared between sessions
    first and nice only counts within one, and the server runs in its own session."""
    try:
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))
    except OSError:
        pass
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.setpriority(os.PRIO_PROCESS, int(task.name), nice)
        except (ProcessLookupError, PermissionError):
            pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2, help="CPU ranks (default 2: one per core here)")
    ap.add_argument("--grad-accum", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=2, help="checkpoint every N steps (both arms)")
    ap.add_argument("--repeats", type=int, default=2, help="off/on pairs, alternating")
    ap.add_argument("--server", choices=["moto", "rclone"], default="moto")
    ap.add_argument("--server-nice", type=int, default=19, help="nice level of the S3 server (default 19)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--workdir", type=Path, help="scratch dir (default: a temp dir, removed)")
    args = ap.parse_args()

    os.environ.update(
        AWS_ACCESS_KEY_ID=TEST_KEY_ID,
        AWS_SECRET_ACCESS_KEY=TEST_SECRET,
        AWS_DEFAULT_REGION="us-east-1",
        AWS_EC2_METADATA_DISABLED="true",
    )
    os.environ.pop("AWS_PROFILE", None)
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-train-upload-"))
    work.mkdir(parents=True, exist_ok=True)
    server = MotoS3() if args.server == "moto" else RcloneS3(work / "rclone-data")
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    with server:
        renice(server._proc.pid, args.server_nice)
        bucket = server.make_bucket()
        for i in range(args.repeats):
            for arm in ("off", "on"):
                storage = (
                    {"url": f"s3://{bucket}/bench/{i}", "endpoint_url": server.endpoint, "keep": 3}
                    if arm == "on"
                    else None
                )
                result = one_run(work, f"{arm}-{i}", args, storage)
                runs[arm].append(result)
                print(
                    f"{arm:3s} #{i}: steady {result['steady_tokens_per_s']:8.1f} tok/s   wall "
                    f"{result['wall_tokens_per_s']:8.1f} tok/s   uploader busy {result['upload_busy']:5.0%} "
                    f"({result['uploads']} uploads of {result['checkpoint_mb']:.1f} MB, {result['superseded']} superseded)   "
                    f"load {result['load_1min']:.1f}",
                    flush=True,
                )

    def median(arm: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[arm])

    ratio_steady = median("on", "steady_tokens_per_s") / median("off", "steady_tokens_per_s")
    ratio_wall = median("on", "wall_tokens_per_s") / median("off", "wall_tokens_per_s")
    print(
        f"\nmedian steady tokens/s: off {median('off', 'steady_tokens_per_s'):.1f}, on "
        f"{median('on', 'steady_tokens_per_s'):.1f}  -> {ratio_steady:.3f}x (goal >= 0.9)"
    )
    print(
        f"median wall tokens/s:   off {median('off', 'wall_tokens_per_s'):.1f}, on "
        f"{median('on', 'wall_tokens_per_s'):.1f}  -> {ratio_wall:.3f}x"
    )
    print(
        f"uploader busy {median('on', 'upload_busy'):.0%} of the training time "
        f"({args.ranks} ranks, {os.cpu_count()} cores, server {args.server} at nice {args.server_nice})"
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "runs": runs,
                    "ratio_steady": ratio_steady,
                    "ratio_wall": ratio_wall,
                },
                indent=1,
            )
        )
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
