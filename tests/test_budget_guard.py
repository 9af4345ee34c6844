"""The budget cap is a node-level guard started by `gpuctl up` (provision/flows/guard.py), not a
watchdog inside a run: it holds with no run at all, after a run that ended early, after a run was
cancelled, and after the SSH connection that started it is gone.

Fast: the guard script itself on this machine (a stand-in teardown); then the fake Vast.ai API
whose instance is the loopback sshd, with a cap of about 20 s, and runs whose DeepSpeed launcher
is a bash stand-in (launch.sh itself is real).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from provision.core import state
from provision.core.config import GpuctlConfig, load_config
from provision.core.errors import GpuctlError
from provision.core.provider_config import VastProvider
from provision.flows import cluster, guard, job
from provision.providers import cloud
from provision.providers.base import SelfTeardown, UpOptions
from provision.providers.local import LocalBackend
from provision.transport.remote import LocalNode
from provision.transport.ssh import node as sshnode
from tests.fakes.guards import kill_guards, running
from tests.fakes.harness import node_fields, ssh_target, text_once_it_says, wait_until, write_config
from tests.fakes.vast_api import FakeVast
from tests.helpers import parent_of

pytestmark = pytest.mark.timeout(180)
CAP_H = 0.006  # 21.6 s from the cluster's creation


class StandIn(LocalBackend):
    """A vendor stand-in for the guard alone: its "teardown" writes a marker with the key it got."""

    def __init__(self, marker: Path):
        self.marker = marker

    def self_teardown(self, cluster):
        script = 'echo "key=${GPUCTL_TEARDOWN_KEY:-none}" > "$1"'
        return SelfTeardown(["bash", "-c", script, "x", str(self.marker)], {"GPUCTL_TEARDOWN_KEY": "k-123"})


def test_the_guard_stops_running_runs_and_tears_down_at_the_cap(tmp_path):
    workdir = tmp_path / "node"
    run_dir = workdir / "runs" / "r1"
    run_dir.mkdir(parents=True)
    run = subprocess.Popen(["setsid", "bash", "-c", "sleep 600 & wait"])  # a run's process group
    (run_dir / "status.json").write_text(json.dumps({"state": "running", "pgid": run.pid}))
    record = state.ClusterRecord(
        name="g",
        provider="vast",
        nodes=[state.NodeRecord(host="node0", workdir=str(workdir))],
        budget_hours=1.0,
        created_at=time.time() - 3600 + 2,  # two seconds of the cap left
    )
    marker = tmp_path / "torn-down"
    try:
        pid = guard.start(record, StandIn(marker), [LocalNode()], say=lambda _: None, stop_wait=2)
        folder = workdir / "guard"
        assert stat.S_IMODE((folder / "guard.env").stat().st_mode) == 0o600
        assert "k-123" not in (folder / "guard.sh").read_text()  # the key is in guard.env only
        assert os.getpgid(pid) == pid != os.getpgid(0)  # its own process group, not gpuctl's
        wait_until(lambda: marker.exists(), 30, "the guard's teardown")
        assert marker.read_text().strip() == "key=k-123"
        assert run.wait(timeout=10) == -signal.SIGTERM  # the running run was stopped first
        log = (folder / "guard.log").read_text()
        assert "budget cap reached (1.00 h since the cluster was created)" in log and "stopped run" in log
    finally:
        kill_guards(tmp_path)
        if run.poll() is None:
            run.kill()


def test_a_guard_started_again_stops_the_first_and_swaps_its_script_whole(tmp_path):
    """replace_node starts the guard again (new instance list, new cap): the first one stops (two
    guards would both tear down, one with a stale list), and guard.sh is replaced by a rename, not
    rewritten under the bash that is still reading it line by line."""
    workdir = tmp_path / "node"
    record = state.ClusterRecord(
        name="g", provider="vast", nodes=[state.NodeRecord(host="node0", workdir=str(workdir))], budget_hours=1.0
    )
    script = workdir / "guard" / "guard.sh"
    try:
        first = guard.start(record, StandIn(tmp_path / "marker"), [LocalNode()], say=lambda _: None)
        before = script.stat().st_ino
        second = guard.start(record, StandIn(tmp_path / "marker"), [LocalNode()], say=lambda _: None)
        assert second != first and running(second)
        wait_until(lambda: not running(first), 15, "the first guard to stop")
        assert script.stat().st_ino != before  # a new file renamed over the old one
        assert not list(script.parent.glob("*.new"))
        # a subshell that outlives its parent for a moment is reparented and looks top-level: a second guard stays
        wait_until(lambda: top_level_guards(workdir) == [second], 15, "the second guard alone")
    finally:
        kill_guards(tmp_path)


def top_level_guards(workdir: Path) -> list[int]:
    """The guard.sh processes in `workdir`, less the subshells bash forks for a moment (a `$(...)` or a
    pipe: same command line, its parent a guard)."""
    guards = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if str(workdir) in _cwd(proc) and b"guard.sh" in (proc / "cmdline").read_bytes():
                guards[int(proc.name)] = parent_of(proc.name)
        except (OSError, ValueError):  # gone meanwhile
            continue
    return sorted(pid for pid, parent in guards.items() if parent not in guards and running(pid))


def _cwd(proc: Path) -> str:
    try:
        return os.readlink(proc / "cwd")
    except OSError:
        return ""


def test_a_detached_start_returns_once_its_group_exists(tmp_path, monkeypatch):
    """On a busy node the child runs setsid late; the guard's start probed the group before it existed
    and failed ("the budget guard did not start", in a full run). A setsid that starts 1 s late."""
    slow = tmp_path / "bin"
    slow.mkdir()
    (slow / "setsid").write_text(f'#!/bin/sh\nsleep 1\nexec {shutil.which("setsid")} "$@"\n')
    (slow / "setsid").chmod(0o755)
    monkeypatch.setenv("PATH", f"{slow}{os.pathsep}{os.environ['PATH']}")
    (tmp_path / "job.sh").write_text("sleep 60\n")
    node = LocalNode()
    pgid = node.start_detached(str(tmp_path), "job.sh", "job.log")
    try:
        assert node.group_alive(pgid) and os.getpgid(pgid) == pgid  # a group of its own, at once
    finally:
        node.signal_group(pgid, "KILL")


def test_a_run_no_longer_carries_a_watchdog_and_refuses_a_spent_cap(tmp_path, monkeypatch):
    from provision.providers import vast

    monkeypatch.setattr(
        vast.VastBackend,
        "self_teardown",
        lambda self, cluster: SelfTeardown(["teardown-cmd"], {"GPUCTL_TEARDOWN_KEY": "k"}),
    )
    cfg = GpuctlConfig(provider=VastProvider(max_hours=1), teardown="never", base_dir=tmp_path)
    node = state.NodeRecord(host="node0", slots=3, workdir="/root/gpuctl", instance_id="1")
    record = state.ClusterRecord(
        name="c", provider="vast", nodes=[node], budget_hours=1.0, created_at=time.time() - 600
    )
    spec = job.bundle_spec(cfg, record, "r1")
    assert spec.after_run == [] and "GPUCTL_TEARDOWN_KEY" not in spec.secrets  # the guard holds the key
    cfg.teardown = "after-train"
    spec = job.bundle_spec(cfg, record, "r2")
    assert spec.after_run == [["teardown-cmd"]] and spec.secrets["GPUCTL_TEARDOWN_KEY"] == "k"
    record.created_at = time.time() - 7200
    with pytest.raises(GpuctlError, match="spent its budget cap"):
        job.bundle_spec(cfg, record, "r3")


# --- the guard on a rented node (fake Vast.ai, the instance is the loopback sshd) ---------------


@pytest.fixture
def fake(sshd, monkeypatch, tmp_path):
    with FakeVast(ssh=ssh_target(sshd)) as server:
        monkeypatch.setenv("VAST_API_KEY", server.key)
        monkeypatch.setattr(cloud, "POLL_S", 0.2)
        yield server
        kill_guards(tmp_path)


def capped_up(project: Path, fake: FakeVast, tmp_path: Path) -> state.ClusterRecord:
    fields = {**node_fields(tmp_path, ranks=1), "python": sys.executable}
    write_config(project, {"kind": "vast", "api_url": fake.url, "max_hours": CAP_H, **fields}, name="capped")
    said: list[str] = []
    record = cluster.up(load_config(project / "gpuctl.yaml"), UpOptions(assume_yes=True, say=said.append))
    assert any("budget guard started on node0" in s for s in said), said
    sshnode._close_all()  # the laptop goes away: every SSH connection of this process drops
    return record


def torn_down_at_the_cap(fake: FakeVast, record: state.ClusterRecord, tmp_path: Path) -> None:
    wait_until(lambda: not fake.instances, 90, "the budget guard to delete the node", every=0.5)
    assert time.time() - record.created_at >= CAP_H * 3600 - 1  # not before the cap
    assert fake.deleted == [int(record.nodes[0].instance_id)]
    log = text_once_it_says(tmp_path / "node" / "guard" / "guard.log", "self-teardown accepted")
    assert "budget cap reached" in log
    assert fake.key not in (tmp_path / "node" / "guard" / "guard.sh").read_text()
    cluster.down(record.name, say=lambda _: None)  # the record goes; the vendor lists nothing


def stand_in_runs(monkeypatch, launcher: str) -> None:
    """`gpuctl train` for real, but DeepSpeed's launcher replaced by a bash stand-in."""
    real = job.bundle_spec

    def bundle_spec(*args, **kwargs):
        spec = real(*args, **kwargs)
        spec.launcher_prefix = ["bash", "-c", launcher, "stand-in"]
        return spec

    monkeypatch.setattr(job, "bundle_spec", bundle_spec)


def test_no_run_at_all_the_node_still_goes_at_the_cap(project, fake, tmp_path):
    record = capped_up(project, fake, tmp_path)
    torn_down_at_the_cap(fake, record, tmp_path)


def test_runs_that_end_early_or_are_cancelled_do_not_take_the_cap_with_them(project, fake, tmp_path, monkeypatch):
    """One cap wait for both (each ~20 s of idle): a run that ends well before the cap, then one that
    is cancelled; the guard `up` started outlives both and still deletes the node at the cap."""
    record = capped_up(project, fake, tmp_path)
    cfg = load_config(project / "gpuctl.yaml")
    stand_in_runs(monkeypatch, "exit 0")
    run = job.start_run(cfg, record, say=lambda _: None)
    status = job.follow(run, lambda _: None)
    assert status.state == "succeeded" and fake.instances  # ended well before the cap
    stand_in_runs(monkeypatch, "sleep 600 & wait")
    run = job.start_run(cfg, record, say=lambda _: None)
    wait_until(lambda: job.read_status(run, job.node_of(run)).state == "running", 30, "the run to start")
    assert job.cancel(run, grace_s=5)
    assert state.load_run(run.run_id).state == "cancelled" and fake.instances
    torn_down_at_the_cap(fake, record, tmp_path)
