"""launch.sh's budget watchdog (BundleSpec.watchdog_s / watchdog_run), run for real with a tiny cap.

The launcher is replaced by a stand-in (launcher_prefix) that hangs or exits at once, so the
watchdog's own behaviour is what is measured: it fires on time and runs the teardown even
though the run hangs, or is killed when the run ends in time (no stray sleeper left).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from provision.core import state
from provision.core.config import GpuctlConfig, VastProvider
from provision.core.errors import GpuctlError
from provision.flows import job
from provision.flows.render import BundleNode, BundleSpec, render_bundle
from tests.fakes.harness import wait_until

pytestmark = pytest.mark.timeout(120)


def bundle(tmp_path: Path, launcher: list[str], watchdog_s: int | None) -> Path:
    out = tmp_path / "run"
    marker = tmp_path / "torn-down"
    spec = BundleSpec(
        run_id="cap-test",
        run_dir=str(out),
        nodes=[BundleNode("localhost", 1)],
        python=sys.executable,
        launcher_prefix=launcher,
        watchdog_s=watchdog_s,
        watchdog_run=[["bash", "-c", 'echo "key=${GPUCTL_TEARDOWN_KEY:-none}" > "$1"', "x", str(marker)]],
        secrets={"GPUCTL_TEARDOWN_KEY": "k-123"},
    )
    render_bundle(GpuctlConfig(base_dir=tmp_path), spec, out)
    return out


def start(run_dir: Path) -> subprocess.Popen:
    log = open(run_dir / "job.log", "w")
    return subprocess.Popen(
        ["setsid", "bash", "launch.sh"], cwd=run_dir, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
    )


def group_alive(pgid: int) -> bool:
    return subprocess.run(["bash", "-c", f"kill -0 -- -{pgid}"], capture_output=True).returncode == 0


def test_the_watchdog_fires_and_tears_down_although_the_run_hangs(tmp_path):
    # The stand-in leaves a grandchild behind when signalled alone, as DeepSpeed's launcher can.
    run_dir = bundle(tmp_path, ["bash", "-c", "sleep 600 & wait", "hang"], watchdog_s=2)
    script = (run_dir / "launch.sh").read_text()
    assert "budget_watchdog &" in script and "sleep 2 &" in script
    started = time.monotonic()
    proc = start(run_dir)
    wait_until(lambda: (tmp_path / "torn-down").exists(), 60, "the watchdog's teardown")
    assert time.monotonic() - started < 30
    assert (tmp_path / "torn-down").read_text().strip() == "key=k-123"  # secrets reach it by env
    proc.wait(timeout=30)
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "cancelled"
    assert "budget cap reached (2s)" in (run_dir / "job.log").read_text()
    wait_until(lambda: not group_alive(proc.pid), 30, "the run's process group to end")


def test_a_run_that_ends_in_time_kills_the_watchdog(tmp_path):
    run_dir = bundle(tmp_path, ["bash", "-c", "exit 0", "quick"], watchdog_s=3)
    proc = start(run_dir)
    proc.wait(timeout=30)
    assert json.loads((run_dir / "status.json").read_text())["state"] == "succeeded"
    wait_until(lambda: not group_alive(proc.pid), 10, "the watchdog and its sleeper to go")
    time.sleep(4)
    assert not (tmp_path / "torn-down").exists()


def test_no_cap_no_watchdog(tmp_path):
    assert "budget_watchdog" not in (bundle(tmp_path, ["true"], watchdog_s=None) / "launch.sh").read_text()


def test_bundle_spec_wires_the_cap_from_the_cluster_record(tmp_path, monkeypatch):
    from provision.providers import vast
    from provision.providers.base import SelfTeardown

    monkeypatch.setattr(
        vast.VastBackend,
        "self_teardown",
        lambda self, cluster: SelfTeardown(["teardown-cmd"], {"GPUCTL_TEARDOWN_KEY": "k"}),
    )
    cfg = GpuctlConfig(provider=VastProvider(max_hours=1), base_dir=tmp_path)
    node = state.NodeRecord(host="node0", slots=3, workdir="/root/gpuctl", instance_id="1")
    cluster = state.ClusterRecord(
        name="c", provider="vast", nodes=[node], budget_hours=1.0, created_at=time.time() - 600
    )
    spec = job.bundle_spec(cfg, cluster, "r1")
    assert 2990 <= spec.watchdog_s <= 3000 and spec.watchdog_run == [["teardown-cmd"]]
    assert spec.after_run == [] and spec.secrets["GPUCTL_TEARDOWN_KEY"] == "k"
    cfg.teardown = "after-train"
    assert job.bundle_spec(cfg, cluster, "r2").after_run == [["teardown-cmd"]]
    cluster.created_at = time.time() - 7200
    with pytest.raises(GpuctlError, match="spent its budget cap"):
        job.bundle_spec(cfg, cluster, "r3")
