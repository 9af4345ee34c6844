"""A node lost mid-run (recovery:, flows/recover.py) against the fake Vast.ai API, whose instances
are the loopback test sshd: the fake preempts an instance (it reports exited, its SSH stops
letting anyone in) and the test kills what ran on it, as the host taking the machine back would.

Fast tests decide "lost or not" and "restart or give up" in-process; the slow one trains for
real, is preempted after a checkpoint and finishes on the other offer.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from provision.core import state
from provision.core.config import load_config
from provision.core.errors import GpuctlError, RemoteError
from provision.flows import recover
from provision.providers import http, vast
from provision.providers.base import UpOptions
from tests.fakes.guards import deadline_of, recovered_cap
from tests.fakes.harness import node_fields, saved_run, serve_vast, wait_until, write_config
from tests.fakes.preempt import freeze_past_a_checkpoint, kill_the_machine, steps
from tests.helpers import GPUCTL

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def fake(sshd, monkeypatch):
    yield from serve_vast(sshd, monkeypatch)


def configure(project: Path, fake, tmp_path: Path, recovery: dict, provider: dict | None = None, **train) -> None:
    prov = {"kind": "vast", "api_url": fake.url, **node_fields(tmp_path), **(provider or {})}
    path = write_config(project, prov, name="vast-rec", **train)
    doc = yaml.safe_load(path.read_text())
    doc["recovery"] = recovery
    path.write_text(yaml.safe_dump(doc))


def up(project: Path, **opts):
    from provision.flows import cluster

    cfg = load_config(project / "gpuctl.yaml")
    record = cluster.up(cfg, UpOptions(assume_yes=True, say=lambda _line: None, **opts))
    return cfg, record


def running_run(record) -> state.RunRecord:
    return saved_run(record.name, "20261203-000000-ab12")


def test_recovery_defaults_and_bid_offers(project, fake, tmp_path):
    configure(project, fake, tmp_path, {}, provider={"interruptible": True})
    cfg = load_config(project / "gpuctl.yaml")
    assert recover.restarts_allowed(cfg) == 3 and cfg.recovery.exclude_lost_hosts
    assert vast.search_query(cfg.provider)["type"] == "bid"  # the client's offer_type "interruptible"
    offers = vast.BACKEND.find_offers(cfg.provider)
    assert offers[0].spot and offers[0].price_per_hour == pytest.approx(0.42)  # 1001's min_bid
    configure(project, fake, tmp_path, {})
    assert recover.restarts_allowed(load_config(project / "gpuctl.yaml")) == 0  # on demand: none


def test_offers_and_up_show_the_bid_and_create_sends_it(project, gpuctl, fake, tmp_path):
    configure(project, fake, tmp_path, {}, provider={"interruptible": True, "bid_per_gpu": 0.2})
    shown = gpuctl("offers")
    assert shown.returncode == 0, shown.stderr
    assert "0.600 bid" in shown.stdout  # 3 GPUs x $0.20
    dry = gpuctl("up", "--dry-run")
    assert "at $0.600/h (" in dry.stderr and "interruptible (bid)" in dry.stderr
    _cfg, record = up(project)
    assert fake.created_bodies[0]["price"] == 0.6 and record.nodes[0].host_id == "51001"
    assert gpuctl("down", "--yes").returncode == 0


def test_preempted_gone_slow_and_offline_are_told_apart(project, fake, tmp_path, monkeypatch):
    configure(project, fake, tmp_path, {"lost_after": 30})
    cfg, record = up(project)
    # the vendor's 503s below are retried 1+2+4+8+16 s by default: what is checked is the answer
    # once the retries are spent, not their schedule (tests/test_provider_http.py holds that)
    monkeypatch.setattr(http, "DEFAULT_RETRY", http.RetryPolicy(attempts=2, first_wait_s=0.01, max_wait_s=0.02))
    watch = recover.LossWatch(running_run(record), record, cfg.recovery.lost_after)
    dropped = RemoteError("connection reset", "retry")
    watch.unreachable(25, dropped)  # a slow or briefly unreachable node the vendor runs: not lost
    with pytest.raises(recover.NodeLost, match="unreachable for 31s"):
        watch.unreachable(31, dropped)  # past lost_after while the vendor still answers
    fake.fail_next = [503] * 50  # the laptop's link is down: the vendor cannot be asked either
    watch.unreachable(10_000, dropped)
    fake.fail_next = []
    fake.preempt(7000001)
    with pytest.raises(recover.NodeLost, match=r"7000001 was preempted or stopped \(exited \(preempted: outbid\)\)"):
        watch.unreachable(1, dropped)
    fake.instances.clear()
    with pytest.raises(recover.NodeLost, match="7000001 is gone"):
        watch.unreachable(1, dropped)


def test_restarts_stop_at_max_restarts(project, fake, tmp_path):
    configure(project, fake, tmp_path, {"max_restarts": 1})
    cfg, record = up(project)
    run = running_run(record)
    earlier = state.RestartEvent(
        at=0,
        reason="earlier",
        old_instance="7000000",
        old_host="51003",
        new_instance="7000001",
        resumed_from=None,
        step=0,
        cost_so_far=0.5,
    )
    state.update_run(run.run_id, restarts=[earlier])
    fake.preempt(7000001)
    with pytest.raises(GpuctlError) as err:
        recover.recover(cfg, run, "instance 7000001 was preempted", print)
    line = err.value.one_line()
    assert "lost: instance 7000001 was preempted; 1 of 1 restart(s) used" in line
    assert "gpuctl up --yes && gpuctl train --resume" in line
    assert not fake.instances and state.find_cluster("vast-rec") is None  # everything terminated
    assert state.load_run(run.run_id).state == "lost" and len(fake.created_bodies) == 1


def test_the_lost_host_is_not_rented_again(project, fake, tmp_path):
    configure(project, fake, tmp_path, {"max_restarts": 2})
    cfg, record = up(project)
    run = running_run(record)
    fake.offers = [o for o in fake.offers if o["id"] != 1003]  # the lost machine's offer is all that is left
    fake.preempt(7000001)
    with pytest.raises(GpuctlError) as err:
        recover.recover(cfg, run, "instance 7000001 was preempted", print)
    assert "recovery failed: no vast offer matches" in err.value.one_line()
    assert "gpuctl train --resume" in err.value.one_line()
    assert not fake.instances and len(fake.created_bodies) == 1  # 1001 is rentable again, but not to this run
    assert state.load_run(run.run_id).state == "lost" and state.find_cluster("vast-rec") is None


def test_restarts_stop_at_the_budget_cap(project, fake, tmp_path):
    configure(project, fake, tmp_path, {"max_restarts": 5}, provider={"max_cost": 2.0})
    cfg, record = up(project, spent_cost=1.99, spent_hours=1.9)  # earlier clusters of the run
    assert record.budget_hours == pytest.approx(0.01 / 1.05)  # the cap counts them
    run = running_run(record)
    state.save_cluster(record.model_copy(update={"spent_cost": 2.0}))
    with pytest.raises(GpuctlError, match=r"the budget cap is spent"):
        recover.recover(cfg, run, "preempted", print)
    assert not fake.instances and len(fake.created_bodies) == 1


def test_status_after_the_laptop_was_away_names_the_resume_command(project, gpuctl, fake, tmp_path):
    configure(project, fake, tmp_path, {"max_restarts": 0})
    _cfg, record = up(project)
    run = running_run(record)
    fake.preempt(7000001)
    shown = gpuctl("status")
    assert shown.returncode == 0, shown.stderr
    assert f"run {run.run_id} lost: vast instance 7000001 was preempted or stopped" in shown.stderr
    assert "gpuctl down --yes && gpuctl up --yes && gpuctl train --resume" in shown.stderr
    assert gpuctl("down", "--yes").returncode == 0 and not fake.instances
    assert state.load_run(run.run_id).state == "lost"


@pytest.mark.slow
@pytest.mark.timeout(900)  # two DeepSpeed starts; on a loaded 2-core machine each can take minutes
def test_e2e_preempted_mid_run_resumes_on_the_other_offer(project, gpuctl, fake, tmp_path):
    configure(project, fake, tmp_path, {"max_restarts": 1}, max_steps=9, checkpoint_every=3)
    assert gpuctl("up", "--yes").returncode == 0
    proc = subprocess.Popen([*GPUCTL, "train"], cwd=project, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        runs = tmp_path / "node" / "runs"
        wait_until(lambda: runs.is_dir() and any(runs.iterdir()), 120, "the run to start")
        run_dir = next(runs.iterdir())
        wait_until(lambda: max(steps(run_dir / "metrics.jsonl"), default=0) >= 4, 600, "step 4", every=0.2)
        before, stored = freeze_past_a_checkpoint(run_dir, project / "gpuctl-storage")  # the uninterrupted run
        fake.preempt(7000001)
        kill_the_machine(run_dir)
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    assert "node lost: vast instance 7000001 was preempted or stopped" in err
    assert 7000001 in fake.deleted and 7000001 not in fake.instances  # gone from the vendor's list
    assert fake.created_bodies[1]["label"].startswith("gpuctl-vast-rec-0-")
    assert [i["ask"]["id"] for i in fake.instances.values()] == [1003]  # not the lost host (1001)
    run = state.list_runs("vast-rec")[-1]
    assert run.state == "succeeded" and run.run_dir.endswith(run_dir.name)  # same run id
    (event,) = run.restarts
    resumed = event.step
    assert event.reason.startswith("vast instance 7000001") and event.old_instance == "7000001"
    assert event.resumed_from == "latest" and resumed == stored and event.cost_so_far > 0
    after = steps(run_dir / "metrics.jsonl")  # the new node's run dir: the same path on this stand-in
    assert sorted(after) == list(range(1, 10))  # metrics.jsonl continues, each step once
    overlap = [s for s in before if s > resumed]
    assert overlap, (resumed, before)
    for step in overlap:  # the resumed steps match the uninterrupted run from that checkpoint
        assert after[step] == pytest.approx(before[step], abs=1e-6), (step, before, after)
    shown = gpuctl("status")
    assert "restart 1," in shown.stdout and "preempted" in shown.stdout, shown.stdout
    assert gpuctl("down", "--yes").returncode == 0 and not fake.instances


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_e2e_no_restarts_the_run_is_lost_and_everything_terminated(project, gpuctl, fake, tmp_path):
    """max_restarts 0, and the laptop away when it happens: `logs -f` finds the lost node."""
    configure(project, fake, tmp_path, {"max_restarts": 0}, max_steps=200, checkpoint_every=0)
    assert gpuctl("up", "--yes").returncode == 0
    started = gpuctl("train", "--detach")
    assert started.returncode == 0, started.stderr
    run_dir = tmp_path / "node" / "runs" / started.stdout.strip()
    wait_until(lambda: max(steps(run_dir / "metrics.jsonl"), default=0) >= 1, 300, "the first step", every=0.2)
    fake.preempt(7000001)
    kill_the_machine(run_dir)
    follow = gpuctl("logs", "-f", timeout=300)
    assert follow.returncode == 1, follow.stdout[-2000:] + follow.stderr[-2000:]
    errors = [x for x in follow.stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and f"run {run_dir.name} lost: vast instance 7000001 was preempted" in errors[0]
    assert "0 of 0 restart(s) used" in errors[0] and "gpuctl up --yes && gpuctl train --resume" in errors[0]
    assert not fake.instances and fake.deleted == [7000001] and len(fake.created_bodies) == 1
    assert state.find_cluster("vast-rec") is None and state.load_run(run_dir.name).state == "lost"


def test_a_node_that_may_have_deleted_itself_is_not_recovered(project, fake, tmp_path):
    configure(project, fake, tmp_path, {"max_restarts": 3})
    cfg, record = up(project)
    run = running_run(record)
    fake.instances.clear()  # gone: with teardown after-train that is the node's own doing after the run
    said: list[str] = []
    assert recover.on_status(run, cfg.model_copy(update={"teardown": "after-train"}), said.append) is None
    assert not said and len(fake.created_bodies) == 1
    state.save_cluster(record.model_copy(update={"budget_hours": 0.001, "created_at": record.created_at - 3600}))
    watch = recover.LossWatch(run, state.load_cluster(record.name), cfg.recovery.lost_after)
    watch.unreachable(1, RemoteError("refused", "retry"))  # past its cap: the guard deleted it


def test_the_seed_takes_the_steps_the_laptop_missed_from_the_checkpoint(state_dir):
    """The laptop followed up to step 2 and was closed; the checkpoint of step 4 carries the run's
    metrics.jsonl (trainer/checkpoint.py): the new node gets steps 1-4, once each, in order."""
    run = saved_run("vast-rec", "20261203-000000-ab13")
    copy = recover.metrics_copy(run)
    copy.parent.mkdir(parents=True)
    copy.write_text('{"step": 1, "loss": 5.0}\n{"step": 2, "loss": 4.5}\n{"step": 3, "lo')  # cut short
    stored = "".join(f'{{"step": {s}, "loss": {6 - s / 2}}}\n' for s in range(1, 6))  # saved with step 5's
    seed = recover._metrics_upto(run, 4, stored)
    assert [json.loads(line)["step"] for line in seed.splitlines()] == [1, 2, 3, 4]
    assert copy.read_text() == seed
    assert recover._metrics_upto(run, 2, "") == seed.split('{"step": 3')[0]  # no checkpoint copy: the laptop's


def test_a_recovered_run_gets_only_what_is_left_of_the_cap(project, fake, tmp_path, monkeypatch):
    """$9 of a $10 cap spent by the run's earlier clusters: the new node's guard gets the $1 left."""
    configure(project, fake, tmp_path, {"max_restarts": 1}, provider={"max_cost": 10.0})
    _cfg, record = up(project)
    new, cap_s, guard_sh = recovered_cap(project, record, lambda: fake.preempt(7000001), monkeypatch, spent_cost=9.0)
    assert new.nodes[0].host_id == "51003" and new.price_per_hour == pytest.approx(1.45)  # not the lost host
    assert cap_s == pytest.approx((10.0 - new.spent_cost) / 1.45 * 3600, abs=30)  # about 41 min, not 6.9 h
    assert deadline_of(guard_sh) - time.time() == pytest.approx(cap_s, abs=30)  # what the new node's guard was given
