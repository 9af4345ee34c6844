"""A RunPod spot pod taken back mid-run (recovery:, flows/recover.py) against the fake GraphQL API:
the pod reports EXITED and its SSH keys stop working; gpuctl tells that from a slow node. A
recovered run's new pod gets only what is left of the budget cap, at the price RunPod bills."""

from __future__ import annotations

import time

import pytest

from provision.core import state
from provision.core.config import load_config
from provision.core.errors import RemoteError
from provision.flows import cluster, recover
from provision.providers.base import UpOptions
from tests.fakes.guards import deadline_of, recovered_cap
from tests.fakes.harness import node_fields, saved_run, serve_runpod, wait_until, write_config
from tests.fakes.preempt import freeze_past_a_checkpoint, kill_the_machine, steps

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def fake(sshd, monkeypatch):
    yield from serve_runpod(sshd, monkeypatch)


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


def test_a_pod_placed_on_the_lost_machine_is_given_back(project, fake, tmp_path):
    """RunPod places a pod itself (a deploy names no machine): the new pod's machineId is checked,
    and one on the lost machine is terminated and asked for again."""
    fake.machines = ["m-lost", "m-lost", "m-other"]
    cfg, record, _run = spot_cluster(project, fake, tmp_path)
    assert record.nodes[0].host_id == "m-lost"  # the pod's machineId
    fake.preempt(record.nodes[0].instance_id)
    from provision.flows import cluster

    cluster.down(record.name, lambda _: None)
    said: list[str] = []
    new = recover._up_again(cfg, UpOptions(assume_yes=True, say=said.append, exclude_hosts={"m-lost"}))
    assert new.nodes[0].host_id == "m-other" and new.nodes[0].instance_id == "fakepod000003"
    assert fake.terminated == ["fakepod000001", "fakepod000002"] and list(fake.pods) == ["fakepod000003"]
    assert any("placed instance fakepod000002 on machine m-lost" in line for line in said)


@pytest.mark.slow
@pytest.mark.timeout(900)  # two DeepSpeed starts; on a loaded 2-core machine each can take minutes
def test_e2e_a_spot_pod_lost_while_the_laptop_was_away_is_replaced_by_logs_f(project, gpuctl, fake, tmp_path):
    """`train --detach`, nothing follows (the laptop is closed), the pod is taken back; `logs -f`
    finds it, rents another pod (not on the lost machine), resumes, follows to the end; and
    metrics.jsonl has every step, although no laptop kept a copy of it (the checkpoint carries one)."""
    fake.machines = ["m-lost", "m-lost", "m-other"]  # RunPod would put the new pod on the lost machine first
    prov = {"kind": "runpod", "api_url": fake.url, "interruptible": True, **node_fields(tmp_path)}
    write_config(project, prov, name="rp-rec", max_steps=9, checkpoint_every=3)
    assert gpuctl("up", "--yes").returncode == 0
    started = gpuctl("train", "--detach")
    assert started.returncode == 0, started.stderr
    run_dir = tmp_path / "node" / "runs" / started.stdout.strip()
    wait_until(lambda: max(steps(run_dir / "metrics.jsonl"), default=0) >= 4, 600, "step 4", every=0.2)
    before, stored = freeze_past_a_checkpoint(run_dir, project / "gpuctl-storage")
    fake.preempt("fakepod000001")
    kill_the_machine(run_dir)
    follow = gpuctl("logs", "-f", timeout=600)
    assert follow.returncode == 0, follow.stdout[-3000:] + follow.stderr[-3000:]
    err = follow.stderr
    assert "node lost: runpod instance fakepod000001 was preempted or stopped (EXITED)" in err
    assert "placed instance fakepod000002 on machine m-lost" in err  # given back, asked again
    assert fake.terminated == ["fakepod000001", "fakepod000002"] and list(fake.pods) == ["fakepod000003"]
    assert all("bidPerGpu" in d for d in fake.deploy_inputs)  # every pod a spot pod
    run = state.load_run(run_dir.name)
    assert run.state == "succeeded"
    (event,) = run.restarts
    assert (event.old_instance, event.new_instance, event.old_host) == ("fakepod000001", "fakepod000003", "m-lost")
    assert event.resumed_from == "latest" and event.step == stored
    after = steps(run_dir / "metrics.jsonl")
    assert sorted(after) == list(range(1, 10))  # no gap: steps 1..stored came from the checkpoint
    overlap = [s for s in before if s > stored]
    assert overlap, (stored, before)
    for step in [*overlap, *range(1, stored + 1)]:  # the resumed steps match the uninterrupted run
        assert after[step] == pytest.approx(before[step], abs=1e-6), (step, before, after)
    shown = gpuctl("status")
    assert "restart 1," in shown.stdout and "fakepod000001 -> fakepod000003" in shown.stdout, shown.stdout
    assert gpuctl("down", "--yes").returncode == 0 and not fake.pods


def test_a_recovered_run_gets_only_what_is_left_of_the_cap(project, fake, tmp_path, monkeypatch):
    """$9 of a $10 cap spent by the run's earlier clusters, and RunPod bills the new pod more than
    its offer said (costPerHr differs): the new pod's guard gets the $1 left, not $10 again."""
    prov = {"kind": "runpod", "api_url": fake.url, "interruptible": True, "max_cost": 10.0, **node_fields(tmp_path)}
    write_config(project, prov, name="rp-cap")
    record = cluster.up(load_config(project / "gpuctl.yaml"), UpOptions(assume_yes=True, say=lambda _: None))
    fake.price_moves = 0.1  # the bill of the next pod differs from its offer

    def lose() -> None:
        fake.preempt(record.nodes[0].instance_id)

    new, cap_s, guard_sh = recovered_cap(project, record, lose, monkeypatch, spent_cost=9.0)
    billed = 3 * (0.204 + 0.1)  # the spot bid per GPU plus the price move, x 3 GPUs
    assert new.nodes[0].instance_id == "fakepod000002"
    assert new.price_per_hour == pytest.approx(billed)  # the bill, not the offer's estimate
    assert cap_s == pytest.approx((10.0 - new.spent_cost) / billed * 3600, abs=30)
    assert cap_s < 1.2 * 3600  # about $1 of time (1.1 h), not $10 of it (11 h)
    assert deadline_of(guard_sh) - time.time() == pytest.approx(cap_s, abs=30)  # what the new pod's guard was given
