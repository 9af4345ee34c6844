"""Start-up overhead of `gpuctl train` over SSH: time to the first training step, against the
same DeepSpeed command started by hand over ssh.

    .venv/bin/python benchmarks/bench_ssh_start.py             # 3 rounds, 1 CPU rank
    .venv/bin/python benchmarks/bench_ssh_start.py --rounds 5 --ranks 2 --json out.json

A loopback sshd (tests/sshd.py) plays the node. `gpuctl up` runs once, untimed.
  gpuctl:  `gpuctl train`: render the bundle, ship it as tar and start launch.sh detached in
           one exec channel (connected while it renders), follow job.log (what the user sees).
  by hand: `ssh node 'cd RUN && env ... python -m deepspeed.launcher.runner ... --module trainer
           run.json'` on a copy of the same bundle already on the node (no render, no copy,
           no status file, no follow), its output streamed back by ssh.
Both start the same interpreter, launcher, world size and trainer; rounds alternate. Each run
is split in three, measured the same way for both: start -> DeepSpeed's runner process
exists (its /proc start time), runner -> first step written (metrics.jsonl `time`: DeepSpeed's
and the trainer's own start-up, the same work in both), written -> printed to the user. The
first and last are what gpuctl adds; on a loaded 2-core machine the middle one swings by
tens of seconds, so the end-to-end medians are printed but the overhead rows compare.
Goal: gpuctl's overhead <= by hand + 2 s.
Needs: openssh-server + openssh-client (apt). Only 127.0.0.1 is contacted.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402

from tests.sshd import SSHD  # noqa: E402

FIRST_STEP = "step 1/"
EXTENSIONS = os.environ.get("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))


def boottime() -> float:
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def launcher_start(under: str, after: float) -> float | None:
    """Boot-clock start time of DeepSpeed's runner process working under `under` (10 ms ticks)."""
    tick = os.sysconf("SC_CLK_TCK")
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if not os.readlink(proc / "cwd").startswith(under):
                continue
            if b"deepspeed.launcher.runner" not in (proc / "cmdline").read_bytes():
                continue
            started = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[19]) / tick
        except (OSError, ValueError, IndexError):
            continue
        if started >= after - 0.02:
            return started
    return None


def timed_run(argv: list[str], env: dict, cwd: Path, node_root: str, timeout: float) -> dict:
    """Run argv to its end. Returns, in seconds from its start: when DeepSpeed's runner process
    started (`pre`), when the first step was printed to us (`seen`), and how long after the
    trainer wrote that step we saw it (`detect`)."""
    found: dict[str, float] = {}
    start = boottime()
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def sample() -> None:
        while proc.poll() is None and "pre" not in found:
            at = launcher_start(node_root, start)
            if at is not None:
                found["pre"] = at - start
            time.sleep(0.02)

    threading.Thread(target=sample, daemon=True).start()
    threading.Thread(target=lambda: proc.stderr.read(), daemon=True).start()
    for line in proc.stdout:
        if "seen" not in found and FIRST_STEP in line:
            found["seen"] = boottime() - start
            found["seen_epoch"] = time.time()
    rc = proc.wait(timeout=timeout)
    if rc != 0 or "seen" not in found or "pre" not in found:
        raise RuntimeError(f"{argv[:4]}... exited {rc}; measured {found}")
    return found


def first_step_epoch(run_dir: str) -> float:
    first = Path(run_dir, "metrics.jsonl").read_text().splitlines()[0]
    return float(json.loads(first)["time"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="bench-ssh-"))
    (tmp / "sshd").mkdir()
    server = SSHD(tmp / "sshd").start()
    project, state = tmp / "project", tmp / "state"
    project.mkdir()
    cfg = {
        "name": "bench",
        "provider": {
            "kind": "ssh",
            "hosts": [server.host()],
            "identity_file": str(server.client_key),
            "python": sys.executable,
            "cpu_ranks": args.ranks,
            "workdir": str(tmp / "node"),
        },
        "train": {"max_steps": args.steps, "checkpoint_every": 0},
        "storage": {"url": str(tmp / "store")},
        "env": {"TORCH_EXTENSIONS_DIR": EXTENSIONS},
    }
    (project / "gpuctl.yaml").write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "GPUCTL_STATE_DIR": str(state)}
    gpuctl = [sys.executable, "-m", "provision.cli"]
    try:
        t = time.monotonic()
        subprocess.run([*gpuctl, "up"], cwd=project, env=env, check=True, capture_output=True, timeout=300)
        up_s = time.monotonic() - t
        ssh = server.ssh_argv()
        node_root = f"{tmp}/node/"
        rows: list[dict] = []
        for round_ in range(args.rounds):
            g = timed_run([*gpuctl, "train"], env, project, node_root, 900)
            run_dir = json.loads(sorted((state / "runs").glob("*.json"), key=os.path.getmtime)[-1].read_text())[
                "run_dir"
            ]
            g["detect"] = g["seen_epoch"] - first_step_epoch(run_dir)
            # the same bundle, already on the node, started by hand
            hand_dir = f"{tmp}/node/by-hand-{round_}"
            shutil.copytree(
                run_dir,
                hand_dir,
                ignore=shutil.ignore_patterns(
                    "cache", "checkpoints", "*.jsonl", "*.log", "status.json", "summary.json"
                ),
            )
            launch = Path(hand_dir, "launch.sh").read_text()
            launcher = next(line for line in launch.splitlines() if "deepspeed.launcher.runner" in line)
            launcher = launcher.split(" &")[0].replace('"$MASTER_PORT"', "29517")
            exports = (
                'DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/lib" '
                f"TORCH_EXTENSIONS_DIR={shlex.quote(EXTENSIONS)}"
            )
            h = timed_run(
                [*ssh, f"cd {shlex.quote(hand_dir)} && env {exports} {launcher}"], env, project, node_root, 900
            )
            h["detect"] = h["seen_epoch"] - first_step_epoch(hand_dir)
            for row in (g, h):
                row["overhead"] = row["pre"] + row["detect"]
            rows.append({"gpuctl": g, "by_hand": h})
            print(
                f"round {round_ + 1}: first step seen after gpuctl {g['seen']:.2f} s / by hand {h['seen']:.2f} s; "
                f"launcher started after {g['pre']:.2f} / {h['pre']:.2f} s; "
                f"step seen {g['detect']:.2f} / {h['detect']:.2f} s after it was written",
                flush=True,
            )

        def med(who: str, key: str) -> float:
            return statistics.median(r[who][key] for r in rows)

        print(f"\n`gpuctl up` (not timed below): {up_s:.2f} s")
        print(f"median of {args.rounds} rounds, {args.ranks} CPU rank(s), loopback sshd:")
        print(f"{'':34}{'gpuctl train':>14}{'by hand':>10}{'extra':>9}")
        for label, key in (
            ("start -> DeepSpeed launcher runs", "pre"),
            ("step written -> seen by the user", "detect"),
            ("overhead (the two above)", "overhead"),
            ("start -> first step seen (end to end)", "seen"),
        ):
            print(
                f"{label:34}{med('gpuctl', key):13.2f}s{med('by_hand', key):9.2f}s"
                f"{med('gpuctl', key) - med('by_hand', key):+8.2f}s"
            )
        print(
            "(end to end includes DeepSpeed's own start-up, identical work for both; on a loaded machine it\n"
            " varies by tens of seconds, so the overhead rows are the comparison. Goal: extra <= +2 s)"
        )
        hand = med("by_hand", "seen")
        gp = med("gpuctl", "seen")
        if args.json:
            args.json.write_text(
                json.dumps(
                    {
                        "up_s": up_s,
                        "ranks": args.ranks,
                        "rounds": rows,
                        "median_gpuctl_s": gp,
                        "median_by_hand_s": hand,
                        "median_extra_overhead_s": med("gpuctl", "overhead") - med("by_hand", "overhead"),
                    },
                    indent=2,
                )
            )
    finally:
        subprocess.run([*gpuctl, "down"], cwd=project, env=env, capture_output=True, timeout=300)
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
