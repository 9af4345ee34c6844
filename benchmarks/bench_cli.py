"""How fast the everyday commands answer: wall time and peak memory of whole `gpuctl` processes,
side by side with SkyPilot's `sky --help` / `sky status` where it is installed.

    .venv/bin/python benchmarks/bench_cli.py                   # 9 runs of each command
    .venv/bin/python benchmarks/bench_cli.py --repeats 15 --against /work/main --json out.json

Commands (none touches a network): `--help`; `status` and `logs` of a finished run recorded on a
local cluster (its job.log, status.json and metrics written as a run leaves them, no training);
`ckpt ls` of a file store holding one published checkpoint; `plan`; `render -o`. Every run is a
fresh `python -m provision.cli` process; its peak RSS is the child's ru_maxrss (os.wait4), its
CPU seconds (user + sys) are printed beside the wall time: on a loaded machine the wall time
swings with the load, the CPU time much less. Each round runs every command once (with
--against, each checkout's in turn, so both see the same load); figures are medians over the
rounds, with the 1-minute load average before and after. A first, untimed round writes the
bytecode (to a cache of the benchmark's own, PYTHONDONTWRITEBYTECODE or not), as an installed
gpuctl has it. Goal: <= 0.25 s and <= 45 MiB per
command, `--help` <= 0.2 s.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RUN_ID = "20261204-000000-be01"
COMMANDS = {
    "--help": ["--help"],
    "status": ["status"],
    "logs": ["logs"],
    "ckpt ls": ["ckpt", "ls"],
    "plan": ["plan"],
    "render -o": ["render", "-o", "{tmp}/bundle"],
}
GOAL_S = {"--help": 0.2}
GOAL_S_DEFAULT, GOAL_MIB = 0.25, 45
SKY = {"--help": ["--help"], "status": ["status"]}


def scenario(root: Path) -> tuple[Path, dict[str, str]]:
    """make_scenario in a child process: this one imports no pydantic or provision, so its memory
    (which a forked child starts from) stays below what it measures. (project dir, env for gpuctl)."""
    subprocess.run([sys.executable, __file__, "--make-scenario", str(root)], check=True)
    env = {**os.environ, "GPUCTL_STATE_DIR": str(root / "state"), "PYTHONPATH": str(ROOT)}
    # Bytecode as an installed gpuctl has it: written once (a warm-up round) to a cache of our own,
    # also where the caller's environment says not to write any (each run would compile from source).
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = str(root / "pycache")
    return root / "project", env


def make_scenario(root: Path) -> None:
    """A project (the default local config, a file store with one checkpoint) and a state dir with
    its local cluster and a finished run."""
    project, state_root, node = root / "project", root / "state", root / "node"
    for folder in (project, state_root, node):
        folder.mkdir(parents=True)
    os.environ["GPUCTL_STATE_DIR"] = str(state_root)
    from provision.core import state
    from provision.core.config import load_config
    from provision.flows.init_config import config_text
    from trainer.objstore.store import CheckpointStore

    text = config_text("local")  # what `gpuctl init` writes
    (project / "gpuctl.yaml").write_text(text.replace("name: null", "name: bench", 1))
    cfg = load_config(project / "gpuctl.yaml")
    state.save_cluster(
        state.ClusterRecord(
            name=cfg.cluster_name, provider="local", nodes=[state.NodeRecord(host="localhost", slots=3)]
        )
    )
    run_dir = node / RUN_ID
    run_dir.mkdir()
    write_finished_run(run_dir)
    state.save_run(
        state.RunRecord(
            run_id=RUN_ID,
            cluster=cfg.cluster_name,
            run_dir=str(run_dir),
            bundle_dir=str(run_dir),
            world_size=3,
            train_batch_size=12,
            micro_batch=1,
            grad_accum=4,
            max_steps=30,
            state="succeeded",
            exit_code=0,
        )
    )
    shard = root / "ckpt" / "step30"
    shard.mkdir(parents=True)
    (shard / "mp_rank_00_model_states.pt").write_bytes(os.urandom(1 << 16))
    store = CheckpointStore.from_config({**cfg.storage_settings(), "url": str(project / "gpuctl-storage")})
    store.upload_shards(shard, "step30", 0, step=30)
    store.publish("step30", 30, world_size=3, num_nodes=1, timeout=10)


def write_finished_run(run_dir: Path) -> None:
    """What a 30-step run leaves in its run dir: job.log, metrics.jsonl, status.json, summary.json."""
    lines = [f"step {s}/30 loss {4.0 - s / 10:.3f} lr 1.00e-03 tok/s 2100" for s in range(1, 31)]
    (run_dir / "job.log").write_text("\n".join(["[launcher] world size 3", *lines, "done"]) + "\n")
    metrics = [{"step": s, "loss": 4.0 - s / 10, "time": 1.0e9 + s, "tokens_per_s": 2100.0} for s in range(1, 31)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    (run_dir / "status.json").write_text(json.dumps({"state": "succeeded", "exit_code": 0, "step": 30}))
    (run_dir / "summary.json").write_text(json.dumps({"steps": 30, "final_loss": 1.0}))


def timed(argv: list[str], cwd: Path, env: dict[str, str]) -> tuple[float, float, float, int]:
    """(wall s, cpu s, peak MiB, exit code) of one whole process."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _pid, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024, proc.returncode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=9, help="runs of each command (median)")
    ap.add_argument("--against", type=Path, action="append", default=[], help="another checkout to time too")
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--make-scenario", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.make_scenario:
        make_scenario(args.make_scenario)
        return
    checkouts = [ROOT, *[p.resolve() for p in args.against]]
    sky = shutil.which("sky")
    with tempfile.TemporaryDirectory(prefix="bench-cli-") as tmp:
        project, env = scenario(Path(tmp))
        samples: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
        load_before = os.getloadavg()[0]
        for round_ in range(args.repeats + 1):  # round 0 warms the bytecode cache, untimed
            for name, cmd in COMMANDS.items():
                for checkout in checkouts:
                    argv = [sys.executable, "-m", "provision.cli", *(a.format(tmp=tmp) for a in cmd)]
                    wall, cpu, mib, code = timed(argv, project, {**env, "PYTHONPATH": str(checkout)})
                    if code != 0:
                        sys.exit(f"{checkout}: gpuctl {' '.join(cmd)} exited {code}")
                    if round_ == 0:
                        continue
                    samples.setdefault((str(checkout), name), []).append((wall, cpu, mib))
                if sky and name in SKY and round_ > 0:
                    wall, cpu, mib, _code = timed([sky, *SKY[name]], project, dict(os.environ))
                    samples.setdefault(("sky", name), []).append((wall, cpu, mib))
        load_after = os.getloadavg()[0]
    print_table(samples, checkouts, sky, args.repeats, (load_before, load_after))
    if args.json:
        figures = {f"{who} {name}": medians(runs) for (who, name), runs in samples.items()}
        args.json.write_text(json.dumps({"load": [load_before, load_after], "median_wall_cpu_mib": figures}, indent=2))


def medians(runs: list[tuple[float, float, float]]) -> tuple[float, float, float]:
    """Median wall s, CPU s and MiB of a command's runs."""
    wall, cpu, mib = (statistics.median(col) for col in zip(*runs, strict=True))
    return wall, cpu, mib


def print_table(samples: dict, checkouts: list[Path], sky: str | None, repeats: int, load: tuple) -> None:
    print(f"median of {repeats} runs; load average (1 min) {load[0]:.2f} before, {load[1]:.2f} after")
    print(f"{'command':<11} {'checkout':<28} {'wall s':>7} {'cpu s':>7} {'MiB':>6}  goal")
    for name in COMMANDS:
        for checkout in checkouts:
            wall, cpu, mib = medians(samples[(str(checkout), name)])
            goal = GOAL_S.get(name, GOAL_S_DEFAULT)
            ok = "ok" if wall <= goal and mib <= GOAL_MIB else "OVER"
            print(
                f"{name:<11} {str(checkout)[-28:]:<28} {wall:>7.3f} {cpu:>7.3f} {mib:>6.1f}  {ok} ({goal} s, {GOAL_MIB} MiB)"
            )
        if name in SKY:
            if sky is None:
                print(f"{name:<11} {'sky':<28} not installed")
            else:
                wall, cpu, mib = medians(samples[("sky", name)])
                print(f"{name:<11} {'sky':<28} {wall:>7.3f} {cpu:>7.3f} {mib:>6.1f}")


if __name__ == "__main__":
    main()
