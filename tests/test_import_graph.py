"""The everyday commands stay light: `gpuctl --help`, and `status` / `logs` / `ckpt ls` (a file
store) / `plan` on a recorded local cluster, load none of the heavy packages below (checked in
sys.modules as the process exits).

Speed itself belongs to benchmarks/bench_cli.py; this keeps the import graph honest, so the next
feature cannot quietly slow every command: a new heavy dependency joins HEAVY.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

# Cloud and SSH clients, the template engine, the node side's stack, and what typer's rich help
# renderer pulls in (markdown-it, pygments): each costs tens of milliseconds to import.
HEAVY = (
    "boto3",
    "botocore",
    "s3transfer",
    "paramiko",
    "fabric",
    "invoke",
    "cryptography",
    "nacl",
    "jinja2",
    "torch",
    "deepspeed",
    "transformers",
    "numpy",
    "requests",
    "markdown_it",
    "pygments",
)

# Runs gpuctl's main as `gpuctl ARGS` would; as the process exits, writes the modules loaded to
# $OUT (an atexit hook: main() ends the process itself, through the hooks, cli/fastpath.py).
WRAPPER = """
import atexit, json, sys
out, sys.argv = sys.argv[1], ["gpuctl", *sys.argv[2:]]

def record():
    with open(out, "w") as f:
        json.dump(sorted(sys.modules), f)

atexit.register(record)
from provision.cli.app import main
main()
"""
OTHER_GROUPS = ("provision.cli.cluster", "provision.cli.ckpt", "provision.cli.image", "provision.cli.doctor")

RUN_ID = "20261204-000000-ig01"


@pytest.fixture
def recorded_local(project: Path) -> Path:
    """A local cluster and a finished run recorded in the state dir, its files where a run leaves them."""
    from provision.core import state

    (project / "gpuctl.yaml").write_text("name: light\nprovider:\n  kind: local\n")
    state.save_cluster(state.ClusterRecord(name="light", provider="local", nodes=[state.NodeRecord(host="localhost")]))
    run_dir = project / "node" / RUN_ID
    run_dir.mkdir(parents=True)
    (run_dir / "job.log").write_text("step 1/1 loss 2.000\n")
    (run_dir / "status.json").write_text(json.dumps({"state": "succeeded", "exit_code": 0}))
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    fields = {"world_size": 1, "train_batch_size": 1, "micro_batch": 1, "grad_accum": 1, "max_steps": 1}
    state.save_run(
        state.RunRecord(run_id=RUN_ID, cluster="light", run_dir=str(run_dir), bundle_dir=str(run_dir), **fields)
    )
    publish_checkpoint(project)
    return project


def publish_checkpoint(project: Path) -> None:
    """One complete checkpoint in the config's file store, as a run publishes it (`ckpt ls` lists it)."""
    from provision.core.config import load_config
    from trainer.objstore.store import CheckpointStore

    shard = project / "ckpt" / "step1"
    shard.mkdir(parents=True)
    (shard / "mp_rank_00_model_states.pt").write_bytes(b"\0" * 4096)
    store = CheckpointStore.from_config(load_config(project / "gpuctl.yaml").storage_settings())
    store.upload_shards(shard, "step1", 0, step=1)
    store.publish("step1", 1, world_size=1, num_nodes=1, timeout=10)


def loaded_by(args: list[str], cwd: Path) -> tuple[list[str], str]:
    """(sys.modules when `gpuctl ARGS` exits, its stdout)."""
    out = cwd / "modules.json"
    proc = subprocess.run(
        [sys.executable, "-c", WRAPPER, str(out), *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(out.read_text()), proc.stdout


@pytest.mark.parametrize(
    ("args", "shows"),
    [
        (["--help"], "status"),
        (["status"], f"run {RUN_ID}: succeeded"),
        (["logs"], "step 1/1 loss 2.000"),
        (["ckpt", "ls"], "step1"),
        (["plan"], "per rank"),
    ],
)
def test_everyday_commands_load_nothing_heavy(recorded_local, args, shows):
    modules, stdout = loaded_by(args, recorded_local)
    assert shows in stdout  # the command did its work: the check below is not of a failed start
    packages = {name.split(".")[0] for name in modules}
    assert [m for m in HEAVY if m in packages] == []
    if args != ["--help"]:  # a command builds its own group's app (provision/cli/app.py GROUPS)
        own = f"provision.cli.{args[0]}"
        assert [m for m in OTHER_GROUPS if m in modules and m != own] == []


def test_the_check_sees_a_heavy_import(recorded_local):
    """The check can fail: a command whose path imports jinja2 (`render`) is caught."""
    modules, _ = loaded_by(["render", "-o", str(recorded_local / "bundle")], recorded_local)
    assert "jinja2" in modules and "provision.cli.jobs" in modules
