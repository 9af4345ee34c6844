"""train.strategy fsdp over two SSH nodes on loopback (127.0.0.1 and 127.0.0.2, the shared sshd fixture):
the first node's torchrun.sh starts node 1's torchrun over the cluster's SSH mesh, both join the
rendezvous on node 0, and the run succeeds with ranks on both nodes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import Gpuctl
from tests.test_ssh_train import metrics, run_record, write_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_fsdp_on_two_nodes(sshd, tmp_path, state_dir):
    project = tmp_path / "fsdp2"
    write_config(
        project,
        sshd,
        [sshd.host("127.0.0.1"), sshd.host("127.0.0.2")],
        name="fsdp2",
        cpu_ranks=1,
        strategy="fsdp",
        max_steps=4,
        seq_len=64,
    )
    gpuctl = Gpuctl(project)
    up = gpuctl("up")
    assert up.returncode == 0, up.stderr
    try:
        train = gpuctl("train")
        assert train.returncode == 0, train.stdout[-4000:] + train.stderr[-3000:]
        record = run_record(state_dir)
        log = Path(record["run_dir"], "job.log").read_text()
        # node 1's torchrun came in over ssh to the second address; node 0's started locally
        assert "gpuctl: node 0 starts 1 rank(s) with torchrun\n" in log, log[-3000:]
        assert "gpuctl: node 1 starts 1 rank(s) with torchrun (over ssh to 127.0.0.2" in log, log[-3000:]
        assert "world 2, global batch" in log
        steps = metrics(record["run_dir"])
        assert [m["step"] for m in steps] == [1, 2, 3, 4] and steps[-1]["loss"] < steps[0]["loss"]
        status = json.loads(Path(record["run_dir"], "status.json").read_text())
        assert status["state"] == "succeeded" and status["exit_code"] == 0
    finally:
        assert gpuctl("down").returncode == 0
