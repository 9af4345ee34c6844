"""A lost node of a 2-node cluster (recovery:, flows/replace_node.py) against the fake Vast.ai API:
only that node is replaced; the other keeps its instance.

The two instances are the loopback sshd on 127.0.0.1 and 127.0.0.2 (one CPU rank each, DeepSpeed's
pdsh launcher between them). They share one sshd and one cluster key, so preempting one cannot
shut its SSH alone: the fake reports it exited and the test kills what ran on it (its DeepSpeed
launch, `--node_rank=1`, and its rank), as the host taking the machine back would. The two share
one file system too, so the run dir is one folder for both.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
from pathlib import Path

import pytest
import yaml

from provision.core import state
from provision.core.config import load_config
from provision.flows import recover, replace_node
from provision.providers import vast
from provision.providers.base import UpOptions
from tests.fakes.harness import node_fields, saved_run, serve_vast, wait_until, write_config
from tests.fakes.preempt import freeze_past_a_checkpoint, signal_run, steps
from tests.fakes.vast_api import offer
from tests.helpers import GPUCTL, free_port
from tests.sshd import children_of

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def fake(sshd, monkeypatch):
    yield from serve_vast(sshd, monkeypatch, addresses=("127.0.0.1", "127.0.0.2"))


def two_nodes(project: Path, fake, tmp_path: Path, recovery: dict, **train):
    """gpuctl.yaml for 2 nodes of 1 CPU rank (offers 1001 and 1003); a third fitting offer, 1019, dearer."""
    fake.offers.append(offer(1019, price=1.60, where="Thirdplace, TP"))
    prov = {"kind": "vast", "api_url": fake.url, "nodes": 2, **node_fields(tmp_path, ranks=1)}
    path = write_config(project, prov, name="vast-two", micro_batch=1, grad_accum=2, **train)
    doc = yaml.safe_load(path.read_text())
    doc["recovery"] = recovery
    path.write_text(yaml.safe_dump(doc))


def test_only_the_lost_node_is_replaced(project, fake, tmp_path, state_dir):
    two_nodes(project, fake, tmp_path, {"max_restarts": 1})
    cfg = load_config(project / "gpuctl.yaml")
    from provision.flows import cluster

    record = cluster.up(cfg, UpOptions(assume_yes=True, say=lambda _: None))
    assert [n.instance_id for n in record.nodes] == ["7000001", "7000002"]
    run = saved_run(record.name, "20261203-000000-ef56")
    fake.preempt(7000002)
    assert replace_node.lost_indices(vast.BACKEND, record) == [1]
    said: list[str] = []
    new = replace_node.replace_lost_nodes(cfg, run, record, [1], {"51003"}, said.append)
    assert new is not None
    assert [n.instance_id for n in new.nodes] == ["7000001", "7000003"]  # node 0 kept its instance
    assert [n.host_id for n in new.nodes] == ["51001", "51019"] and new.world_size == 2
    assert [n.address for n in new.nodes] == ["127.0.0.1", "127.0.0.2"]
    assert fake.deleted == [7000002] and sorted(fake.instances) == [7000001, 7000003]
    assert new.price_per_hour == pytest.approx(1.05 + 1.60) and new.spent_cost > 0
    mesh_config = Path(new.nodes[0].workdir, "ssh", "config").read_text()
    assert "127.0.0.2" in mesh_config and any("node-to-node SSH ready" in line for line in said)
    assert state.load_cluster("vast-two").nodes[1].instance_id == "7000003"


def test_no_replacement_offer_gives_the_whole_cluster_path(project, fake, tmp_path):
    two_nodes(project, fake, tmp_path, {"max_restarts": 1})
    cfg = load_config(project / "gpuctl.yaml")
    from provision.flows import cluster

    record = cluster.up(cfg, UpOptions(assume_yes=True, say=lambda _: None))
    run = saved_run(record.name, "20261203-000000-ef57")
    fake.offers = [o for o in fake.offers if o["id"] != 1019]
    fake.preempt(7000002)
    said: list[str] = []
    assert replace_node.replace_lost_nodes(cfg, run, record, [1], {"51003"}, said.append) is None
    assert "replacing the whole cluster" in said[-1] and sorted(fake.instances) == [7000001]
    with pytest.raises(recover.GpuctlError, match="recovery failed: only 1 Vast.ai offer"):  # 1001; 1003 was lost
        recover.recover(cfg, run, "instance 7000002 was preempted", said.append)
    assert not fake.instances and state.find_cluster("vast-two") is None


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _node1_processes(workdir: Path) -> list[int]:
    """DeepSpeed's launch on node 1 (pdsh gave it --node_rank=1) in this test's node workdir (another
    test's two-node run may be going) and everything under it."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().split(b"\0")
            ours = os.readlink(cmdline.parent / "cwd").startswith(str(workdir))
        except OSError:
            continue
        if ours and b"--node_rank=1" in argv and b"deepspeed.launcher.launch" in argv:
            pid = int(cmdline.parent.name)
            return [pid, *children_of(pid)]
    raise AssertionError("no DeepSpeed launch with --node_rank=1")


@pytest.mark.slow
@pytest.mark.timeout(900)  # two DeepSpeed starts on 2 nodes; on a loaded 2-core machine each takes minutes
def test_e2e_a_lost_second_node_is_replaced_and_the_run_resumes(project, gpuctl, fake, tmp_path):
    two_nodes(project, fake, tmp_path, {"max_restarts": 1}, max_steps=16, checkpoint_every=2, seq_len=64)
    assert gpuctl("up", "--yes").returncode == 0
    runs = tmp_path / "node" / "runs"
    proc = subprocess.Popen([*GPUCTL, "train"], cwd=project, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: runs.is_dir() and any(runs.iterdir()), 120, "the run to start")
        run_dir = next(runs.iterdir())
        before, stored = freeze_past_a_checkpoint(
            run_dir, project / "gpuctl-storage", functools.partial(signal_run, run_dir)
        )
        fake.preempt(7000002)  # the vendor says exited; what ran there ends with the machine
        _signal(_node1_processes(tmp_path / "node"), signal.SIGKILL)
        # node 0's processes stay stopped, as ranks hung in a collective with a lost peer would: the
        # follow reads its files, the vendor names node 1, recovery kills them (SIGKILL ends stopped ones)
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            for folder in runs.iterdir():  # nothing stopped stays behind a failed test
                signal_run(folder, signal.SIGKILL)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    assert "node lost: vast instance 7000002 was preempted or stopped" in err
    assert "replacing lost node(s) node1 (7000002); the other 1 keep their instances" in err
    assert 7000002 in fake.deleted and 7000002 not in fake.instances  # gone from the vendor's list
    assert 7000001 not in fake.deleted and sorted(fake.instances) == [7000001, 7000003]  # node 0 kept
    assert state.load_cluster("vast-two").nodes[0].instance_id == "7000001"
    run = state.list_runs("vast-two")[-1]
    assert run.state == "succeeded" and run.run_dir.endswith(run_dir.name) and run.world_size == 2
    (event,) = run.restarts
    assert (event.old_instance, event.new_instance, event.old_host) == ("7000002", "7000003", "51003")
    assert event.resumed_from == "latest" and event.step == stored
    log = (run_dir / "job.log").read_text()
    assert "node1: " in log and "dist_world_size=2" in log  # the resumed run is 2 nodes again (pdsh)
    after = steps(run_dir / "metrics.jsonl")
    assert sorted(after) == list(range(1, 17))  # metrics.jsonl continues, each step once
    overlap = [s for s in before if s > event.step]
    assert overlap, (event.step, before)
    for step in overlap:  # the resumed steps match the uninterrupted run from that checkpoint
        assert after[step] == pytest.approx(before[step], abs=1e-6), (step, before, after)
    shown = gpuctl("status")
    assert "restart 1," in shown.stdout and "7000002 -> 7000003" in shown.stdout, shown.stdout
    assert gpuctl("down", "--yes").returncode == 0 and not fake.instances


def test_a_survivor_that_does_not_answer_gives_the_whole_cluster_path(project, fake, tmp_path):
    two_nodes(project, fake, tmp_path, {"max_restarts": 1})
    cfg = load_config(project / "gpuctl.yaml")
    from provision.flows import cluster

    record = cluster.up(cfg, UpOptions(assume_yes=True, say=lambda _: None))
    run = saved_run(record.name, "20261203-000000-ef58")
    fake.preempt(7000002)
    record.nodes[0].port = free_port()  # node 0 stays listed by the vendor but nothing answers there
    said: list[str] = []
    assert replace_node.replace_lost_nodes(cfg, run, record, [1], {"51003"}, said.append) is None
    assert "does not answer" in said[-1] and said[-1].endswith("replacing the whole cluster")
    assert sorted(fake.instances) == [7000001, 7000002] and len(fake.created_bodies) == 2  # nothing new rented
