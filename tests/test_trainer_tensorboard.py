"""train.tensorboard: rendered into ds_config as DeepSpeed's monitor block, which DeepSpeed's own
config parser accepts; without the optional tensorboard package the trainer warns once and goes on."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from provision.core.config import GpuctlConfig
from provision.flows.render import BundleNode, BundleSpec, render_bundle
from tests.helpers import free_port

pytestmark = pytest.mark.timeout(180)

MONITOR_CHECK = textwrap.dedent("""
    import json, os, sys
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", DS_ACCELERATOR="cpu")
    import deepspeed
    from deepspeed.runtime.config import DeepSpeedConfig
    deepspeed.init_distributed(dist_backend="gloo")

    class DataParallel:
        def get_data_parallel_world_size(self):
            return 1

    tb = DeepSpeedConfig(sys.argv[1], mpu=DataParallel()).monitor_config.tensorboard
    print(json.dumps({"enabled": tb.enabled, "output_path": tb.output_path, "job_name": tb.job_name}))
""")


def render(tmp_path, **train) -> dict:
    cfg = GpuctlConfig.model_validate({"train": {"grad_accum": 2, **train}})
    spec = BundleSpec(
        run_id="20261202-111500-ab12", run_dir=str(tmp_path), nodes=[BundleNode("localhost", 1)], python="python3"
    )
    render_bundle(cfg, spec, tmp_path)
    return json.loads((tmp_path / "ds_config.json").read_text())


def test_tensorboard_block_rendered_and_accepted_by_deepspeed(tmp_path):
    ds = render(tmp_path, tensorboard=True)
    block = {"enabled": True, "output_path": "tensorboard/", "job_name": "20261202-111500-ab12"}
    assert ds["tensorboard"] == block
    out = subprocess.run(
        [sys.executable, "-c", MONITOR_CHECK, str(tmp_path / "ds_config.json"), str(free_port())],
        check=False,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == block
    run = json.loads((tmp_path / "run.json").read_text())
    from trainer.config import parse_run_config

    assert not parse_run_config(run, tmp_path).warnings  # the trainer knows the key: no "unknown key" line


def test_tensorboard_off_by_default(tmp_path):
    assert "tensorboard" not in render(tmp_path)


def test_trainer_warns_once_without_the_tensorboard_package(monkeypatch):
    pytest.importorskip("deepspeed")
    from trainer.loop import tensorboard_or_off

    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import fails as if not installed
    said: list[str] = []
    ds = {"tensorboard": {"enabled": True, "output_path": "tensorboard/", "job_name": "r"}}
    tensorboard_or_off(ds, said.append)
    assert ds["tensorboard"]["enabled"] is False  # DeepSpeed would raise ImportError on rank 0 otherwise
    assert (
        len(said) == 1
        and said[0].startswith("warning: train.tensorboard is on")
        and "pip install tensorboard" in said[0]
    )
    said.clear()
    tensorboard_or_off({"tensorboard": {"enabled": False}}, said.append)
    tensorboard_or_off({}, said.append)
    assert said == []


def test_logged_steps_go_to_deepspeeds_monitor(tmp_path):
    pytest.importorskip("deepspeed")
    from types import SimpleNamespace

    from trainer.loop import Batching, RunStats, record_step
    from trainer.metrics import MetricsLog

    events: list = []
    monitor = SimpleNamespace(enabled=True, write_events=events.extend)
    engine = SimpleNamespace(monitor=monitor, was_step_applied=lambda: True)
    run = SimpleNamespace(
        geo=Batching(1, 2, 1, 8),
        params=1000,
        env=SimpleNamespace(world_size=1),
        peak_tflops=None,
        precision="fp32",
        engine=engine,
    )
    pos = SimpleNamespace(step=3, samples_seen=6)
    record_step(run, MetricsLog(tmp_path, 5), RunStats(), pos, 1e-3, 2.5, None, 0.5)
    assert events == [("gpuctl/loss", 2.5, 3), ("gpuctl/lr", 1e-3, 3), ("gpuctl/tokens_per_s", 32.0, 3)]
    monitor.enabled = False
    record_step(run, MetricsLog(tmp_path, 5), RunStats(), pos, 1e-3, 2.5, None, 0.5)
    assert len(events) == 3
