"""Start-up overhead of `gpuctl train` over SSH: time to the first training step, against the
same DeepSpeed command started by hand over ssh.

    .venv/bin/python benchmarks/bench_ssh_start.py             # 3 rounds, 1 CPU rank
    .venv/bin/python benchmarks/bench_ssh_start.py --rounds 5 --ranks 2 --json out.json

A loopback sshd (tests/sshd.py) plays the node. `gpuctl up` runs once, untimed.
  gpuctl:  `gpuctl train` from launch to the first "step 1/" line it prints (render the
           bundle, SFTP it, start launch.sh detached, follow job.log: the user's view).
  by hand: `ssh node 'cd RUN && env ... python -m deepspeed.launcher.runner ... --module trainer
           run.json'` on a copy of the same bundle already on the node (no render, no copy,
           no status file, no follow), from launch to its first "step 1/" line.
Both start the same interpreter, launcher, world size and trainer; rounds alternate so drift
in machine load hits both. Medians are reported; the goal is gpuctl <= by hand + 2 s.
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


def time_to_line(argv: list[str], needle: str, env: dict, cwd: Path, timeout: float) -> tuple[float, dict]:
    """Seconds from starting argv until a stdout line contains needle; lets it run to the end."""
    marks: dict[str, float] = {}
    start = time.monotonic()
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def watch_err() -> None:
        for line in proc.stderr:
            if " started on " in line and "started" not in marks:
                marks["started"] = time.monotonic() - start

    threading.Thread(target=watch_err, daemon=True).start()
    found = None
    for line in proc.stdout:
        if found is None and needle in line:
            found = time.monotonic() - start
    rc = proc.wait(timeout=timeout)
    if found is None or rc != 0:
        raise RuntimeError(f"{argv[:4]}... exited {rc} without {needle!r}")
    return found, marks


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
    cfg = {"name": "bench", "provider": {"kind": "ssh", "hosts": [server.host()], "identity_file": str(server.client_key),
                                         "python": sys.executable, "cpu_ranks": args.ranks, "workdir": str(tmp / "node")},
           "train": {"max_steps": args.steps, "checkpoint_every": 0}, "storage": {"url": str(tmp / "store")},
           "env": {"TORCH_EXTENSIONS_DIR": EXTENSIONS}}
    (project / "gpuctl.yaml").write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "GPUCTL_STATE_DIR": str(state)}
    gpuctl = [sys.executable, "-m", "provision.cli"]
    try:
        t = time.monotonic()
        subprocess.run([*gpuctl, "up"], cwd=project, env=env, check=True, capture_output=True, timeout=300)
        up_s = time.monotonic() - t
        ssh = server.ssh_argv()
        results: dict[str, list[float]] = {"gpuctl": [], "by_hand": [], "gpuctl_started": []}
        for round_ in range(args.rounds):
            took, marks = time_to_line([*gpuctl, "train"], FIRST_STEP, env, project, 900)
            results["gpuctl"].append(took)
            results["gpuctl_started"].append(marks.get("started", float("nan")))
            # the same bundle, already on the node, started by hand
            run_dir = json.loads(sorted((state / "runs").glob("*.json"), key=os.path.getmtime)[-1].read_text())["run_dir"]
            hand_dir = f"{tmp}/node/by-hand-{round_}"
            shutil.copytree(run_dir, hand_dir, ignore=shutil.ignore_patterns(
                "cache", "checkpoints", "*.jsonl", "*.log", "status.json", "summary.json"))
            launch = Path(hand_dir, "launch.sh").read_text()
            launcher = next(line for line in launch.splitlines() if "deepspeed.launcher.runner" in line)
            launcher = launcher.split(" &")[0].replace('"$MASTER_PORT"', "29517")
            exports = "DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 PYTHONPATH=\"$PWD/lib\" " \
                      f"TORCH_EXTENSIONS_DIR={shlex.quote(EXTENSIONS)}"
            remote = f"cd {shlex.quote(hand_dir)} && env {exports} {launcher}"
            took, _ = time_to_line([*ssh, remote], FIRST_STEP, env, project, 900)
            results["by_hand"].append(took)
            print(f"round {round_ + 1}: gpuctl {results['gpuctl'][-1]:.2f} s "
                  f"(run started after {results['gpuctl_started'][-1]:.2f} s), by hand {took:.2f} s", flush=True)
        gp, hand = statistics.median(results["gpuctl"]), statistics.median(results["by_hand"])
        started = statistics.median(results["gpuctl_started"])
        print(f"\n`gpuctl up` (untimed above): {up_s:.2f} s")
        print(f"time to first step, median of {args.rounds} ({args.ranks} CPU rank(s), loopback sshd):")
        print(f"  gpuctl train       {gp:7.2f} s   (render + SFTP + detached start done after {started:.2f} s)")
        print(f"  by hand over ssh   {hand:7.2f} s")
        print(f"  difference         {gp - hand:+7.2f} s   (goal <= +2 s)")
        if args.json:
            args.json.write_text(json.dumps({"up_s": up_s, "ranks": args.ranks, **results,
                                             "median_gpuctl_s": gp, "median_by_hand_s": hand,
                                             "difference_s": gp - hand}, indent=2))
    finally:
        subprocess.run([*gpuctl, "down"], cwd=project, env=env, capture_output=True, timeout=300)
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
