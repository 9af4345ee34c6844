"""A RunPod spot pod taken back mid-run (recovery:, flows/recover.py) against the fake GraphQL API:
the pod reports EXITED and its SSH keys stop working; gpuctl tells that from a slow node."""

from __future__ import annotations

import pytest

from provision.core import state
from provision.core.config import load_config
from provision.core.errors import RemoteError
from provision.flows import recover
from provision.providers import cloud
from provision.providers.base import UpOptions
from tests.fakes.harness import node_fields, saved_run, ssh_target, write_config
from tests.fakes.runpod_api import FakeRunPod

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def fake(sshd, monkeypatch):
    with FakeRunPod(ssh=ssh_target(sshd)) as server:
        monkeypatch.setenv("RUNPOD_API_KEY", server.key)
        monkeypatch.setattr(cloud, "POLL_S", 0.2)
        yield server


def spot_cluster(project, fake, tmp_path):
    prov = {"kind": "runpod", "api_url": fake.url, "interruptible": True, **node_fields(tmp_path)}
    write_config(project, prov, name="rp-rec")
    cfg = load_config(project / "gpuctl.yaml")
    from provision.flows import cluster

    record = cluster.up(cfg, UpOptions(assume_yes=True, say=lambda _: None))
    run = saved_run(record.name, "20261203-000000-cd34")
    return cfg, record, run


def test_a_preempted_spot_pod_is_lost_and_a_running_one_is_not(project, fake, tmp_path):
    cfg, record, run = spot_cluster(project, fake, tmp_path)
    assert recover.restarts_allowed(cfg) == 3  # interruptible: recovery on by default
    watch = recover.LossWatch(run, record, cfg.recovery.lost_after)
    dropped = RemoteError("connection reset", "retry")
    watch.unreachable(60, dropped)  # the pod runs; only the link is slow: reconnect
    pod_id = record.nodes[0].instance_id
    fake.preempt(pod_id)
    with pytest.raises(recover.NodeLost, match=f"runpod instance {pod_id} was preempted or stopped \\(EXITED\\)"):
        watch.unreachable(1, dropped)
    fake.pods.clear()
    with pytest.raises(recover.NodeLost, match="is gone"):
        watch.unreachable(1, dropped)


def test_status_names_the_resume_command_without_recovery(project, gpuctl, fake, tmp_path):
    _cfg, record, run = spot_cluster(project, fake, tmp_path)
    path = project / "gpuctl.yaml"
    path.write_text(path.read_text() + "recovery:\n  max_restarts: 0\n")
    fake.preempt(record.nodes[0].instance_id)
    shown = gpuctl("status")
    assert shown.returncode == 0, shown.stderr
    assert f"run {run.run_id} lost: runpod instance {record.nodes[0].instance_id} was preempted" in shown.stderr
    assert "gpuctl train --resume" in shown.stderr
    assert gpuctl("down", "--yes").returncode == 0 and not fake.pods
    assert state.load_run(run.run_id).state == "lost"
