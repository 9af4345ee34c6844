"""Issue 34 item 3: `secrets:` on a two-node run (127.0.0.1 and 127.0.0.2 behind the loopback sshd,
DeepSpeed's pdsh launcher, one CPU rank each), one name for each prefix DeepSpeed's runner copies
from the launcher's environment onto pdsh's command line and into job.log (MLFLOW, PYTHON, MV2, UCX;
NCCL on CUDA nodes, and its per-node launcher logs every *NCCL* variable on any node).

The same for train.strategy fsdp (torchrun.sh starts node 1's torchrun over ssh).

Every rank of both nodes ends up with every value, although neither node's shell had one when its
ranks started (the ranks' shells start from sshd); no value is in any process's argv while the run
goes, in job.log, in what gpuctl printed (`logs` included), or in any file of the state dir (bundles,
records) or the nodes' run dir; the secrets file is gone at the end.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import Gpuctl
from tests.sshd import SSHD
from tests.test_hardening_secrets import SITECUSTOMIZE, ArgvWatch, leaks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
pytest.importorskip("deepspeed")
EXTENSIONS = os.environ.get(
    "TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parents[1] / ".cache" / "torch_extensions")
)
SECRETS = {
    name: f"{name.split('_')[0].lower()}-secret-" + hashlib.sha256(name.encode()).hexdigest()[:20]
    for name in ("MLFLOW_TRACKING_TOKEN", "PYTHON_GPUCTL_KEY", "MV2_GPUCTL_KEY", "UCX_GPUCTL_KEY", "NCCL_GPUCTL_KEY")
}


# strategy -> (a process of every node's rank launch, that the argv samples must catch; what job.log says of node 1)
LAUNCHES = {
    "deepspeed": (b"deepspeed.launcher.launch", "cmd = pdsh"),  # DeepSpeed's runner and its pdsh command
    "fsdp": (b"torch.distributed.run", "gpuctl: node 1 starts 1 rank(s) with torchrun"),  # torchrun.sh over ssh
}


@pytest.mark.parametrize("strategy", sorted(LAUNCHES))
def test_every_prefix_deepspeed_exports_reaches_both_nodes_ranks_and_nothing_else(
    sshd: SSHD, tmp_path, state_dir, strategy
):
    project, hook = tmp_path / "project", tmp_path / "hook"
    project.mkdir()
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)  # each rank reports what it held, at exit
    cfg = {
        "name": "sec2",
        "provider": {
            "kind": "ssh",
            "hosts": [sshd.host("127.0.0.1"), sshd.host("127.0.0.2")],
            "identity_file": str(sshd.client_key),
            "python": sys.executable,
            "cpu_ranks": 1,
            "workdir": str(project / "node"),
            "authorized_keys": str(sshd.authorized_keys),
            "ready_timeout": 30,
        },
        # the fewest steps that start and end both nodes' ranks; DeepSpeed: torch's Adam (no CPU Adam op to build)
        "train": {
            "strategy": strategy,
            **({"offload_optimizer": "none"} if strategy == "deepspeed" else {}),
            "max_steps": 1,
            "checkpoint_every": 0,
            "seq_len": 32,
        },
        "storage": {"url": str(project / "store")},
        "secrets": sorted(SECRETS),
        "env": {
            "PYTHONPATH": f"lib:{hook}",  # lib: the run dir's trainer copy, as launch.sh sets it
            "TORCH_EXTENSIONS_DIR": EXTENSIONS,
            "GPUCTL_TEST_SECRET_NAMES": ",".join(sorted(SECRETS)),
        },
    }
    (project / "gpuctl.yaml").write_text(yaml.safe_dump(cfg))
    gpuctl = Gpuctl(project, {**os.environ, **SECRETS})
    assert gpuctl("up").returncode == 0, gpuctl.outputs[-1]
    try:
        # `during`: DeepSpeed's per-node launcher, which pdsh starts on both nodes, was in the samples
        with ArgvWatch(*SECRETS.values(), during=LAUNCHES[strategy][0]) as argv:
            train = gpuctl("train")
        assert train.returncode == 0, train.stdout[-4000:] + train.stderr[-3000:]
        logs = gpuctl("logs")
        assert logs.returncode == 0, logs.stderr
        run = json.loads(gpuctl("status", "--json").stdout)["run"]
    finally:
        gpuctl("down", "--yes")

    run_dir = Path(run["run_dir"])
    log = (run_dir / "job.log").read_text()
    assert LAUNCHES[strategy][1] in log and "127.0.0.2" in log  # really two nodes
    assert argv.caught >= 2 and argv.hits == [], argv.hits
    for value in SECRETS.values():
        assert value not in log and not [o for o in gpuctl.outputs if value in o]
        assert leaks(value, state_dir, project) == []  # bundles, records, the run dir (job.log, .deepspeed_env)
    ranks = {p.name: json.loads(p.read_text()) for p in hook.glob("rank*.json")}
    assert sorted(ranks) == ["rank0.json", "rank1.json"], ranks
    want = {name: hashlib.sha256(value.encode()).hexdigest() for name, value in SECRETS.items()}
    for name, seen in ranks.items():
        assert seen["seen"] == want, name  # the rank had every value ...
        assert seen["env_at_start"] == [] and seen["file_at_start"], (name, seen)  # ... from the file only
        assert seen["argv_leaks"] == [] and not seen["file_at_exit"], (name, seen)
    assert not (run_dir / "secrets.env").exists()
