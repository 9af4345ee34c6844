"""The rendered bundle: DeepSpeed's own parsers accept it; values are encoded, not pasted."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from provision.cli.app import app
from provision.core.config import GpuctlConfig
from provision.flows.render import BundleNode, BundleSpec, render_bundle
from tests.helpers import free_port

runner = CliRunner()
SEED = """
provider: {kind: local, gpus_per_node: 3}
train: {micro_batch: 1, grad_accum: 4, zero_stage: 2, offload_optimizer: cpu,
        precision: fp16, lr: 5.0e-5, train_batch_size: 12}
"""

DS_CHECK = textwrap.dedent("""
    import json, os, sys
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[3], RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", DS_ACCELERATOR="cpu")
    import deepspeed
    from deepspeed.runtime.config import DeepSpeedConfig
    deepspeed.init_distributed(dist_backend="gloo")

    class DataParallel:  # what DeepSpeed asks an mpu for: the data-parallel world size
        def get_data_parallel_world_size(self):
            return int(sys.argv[2])

    cfg = DeepSpeedConfig(sys.argv[1], mpu=DataParallel())
    print(json.dumps({"train_batch_size": cfg.train_batch_size,
                      "micro": cfg.train_micro_batch_size_per_gpu,
                      "gas": cfg.gradient_accumulation_steps,
                      "stage": cfg.zero_optimization_stage,
                      "offload": str(cfg.zero_config.offload_optimizer.device) if cfg.zero_config.offload_optimizer else None,
                      "fp16": cfg.float16_config.enabled, "bf16": cfg.bfloat16_config.enabled}))
""")


def deepspeed_reads(ds_config: Path, world: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", DS_CHECK, str(ds_config), str(world), str(free_port())],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_seed_setup_renders_what_deepspeed_accepts(project):
    (project / "gpuctl.yaml").write_text(SEED)
    result = runner.invoke(app, ["render", "-o", "bundle"])
    assert result.exit_code == 0, result.stderr
    bundle = project / "bundle"
    from deepspeed.launcher.runner import fetch_hostfile

    assert dict(fetch_hostfile(str(bundle / "hostfile"))) == {"localhost": 3}
    assert (bundle / "hostfile").read_text() == "localhost slots=3\n"
    parsed = deepspeed_reads(bundle / "ds_config.json", 3)
    assert parsed == {
        "train_batch_size": 12,
        "micro": 1,
        "gas": 4,
        "stage": 2,
        "offload": "cpu",
        "fp16": True,
        "bf16": False,
    }
    run = json.loads((bundle / "run.json").read_text())
    assert run["train"]["lr"] == 5e-5 and run["num_nodes"] == 1
    assert (bundle / "lib" / "trainer" / "__init__.py").is_file()
    assert os.access(bundle / "launch.sh", os.X_OK)
    assert oct((bundle / ".deepspeed_env").stat().st_mode & 0o777) == "0o600"
    subprocess.run(["bash", "-n", str(bundle / "launch.sh")], check=True)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cpu_bundle_without_offload(tmp_path, precision):
    cfg = GpuctlConfig.model_validate(
        {"train": {"precision": precision, "offload_optimizer": "none", "zero_stage": 1, "grad_accum": 2}}
    )
    spec = BundleSpec(run_id="r", run_dir=str(tmp_path), nodes=[BundleNode("localhost", 2)], python="python3")
    render_bundle(cfg, spec, tmp_path)
    ds = json.loads((tmp_path / "ds_config.json").read_text())
    assert ds["optimizer"]["params"]["torch_adam"] is True  # CPU without offload: no JIT compile
    assert "offload_optimizer" not in ds["zero_optimization"]
    parsed = deepspeed_reads(tmp_path / "ds_config.json", 2)
    assert parsed["train_batch_size"] == 4 and parsed["stage"] == 1 and parsed["offload"] is None
    assert parsed["bf16"] is (precision == "bf16")


def test_multi_node_hostfile_and_launcher(tmp_path):
    cfg = GpuctlConfig.model_validate({"env": {"NCCL_DEBUG": "INFO"}})
    spec = BundleSpec(
        run_id="r",
        run_dir=str(tmp_path),
        python="python3",
        accelerator="cuda",
        gpu_name="NVIDIA GeForce RTX 4090",
        master_addr="10.0.0.1",
        ssh_port=2222,
        nodes=[BundleNode("10.0.0.1", 3), BundleNode("10.0.0.2", 3)],
    )
    render_bundle(cfg, spec, tmp_path)
    from deepspeed.launcher.runner import fetch_hostfile

    assert dict(fetch_hostfile(str(tmp_path / "hostfile"))) == {"10.0.0.1": 3, "10.0.0.2": 3}
    launch = (tmp_path / "launch.sh").read_text()
    assert "--launcher pdsh" in launch and "--ssh_port 2222" in launch and "--master_addr 10.0.0.1" in launch
    env_lines = (tmp_path / ".deepspeed_env").read_text().splitlines()
    assert {"NCCL_P2P_DISABLE=1", "NCCL_IB_DISABLE=1", "NCCL_DEBUG=INFO"} <= set(env_lines)


def test_user_overrides_rtx40_nccl_defaults(tmp_path):
    cfg = GpuctlConfig.model_validate({"env": {"NCCL_P2P_DISABLE": "0"}})
    spec = BundleSpec(
        run_id="r",
        run_dir=str(tmp_path),
        python="python3",
        accelerator="cuda",
        gpu_name="NVIDIA GeForce RTX 4090",
        nodes=[BundleNode("a", 3), BundleNode("b", 3)],
    )
    render_bundle(cfg, spec, tmp_path)
    assert "NCCL_P2P_DISABLE=0" in (tmp_path / ".deepspeed_env").read_text().splitlines()


NASTY = ["a b", "x;rm -rf /tmp/nope", "$(touch /tmp/gpuctl-pwned)", "it's", 'say "hi"', "back`tick`", "new\nline"]


@pytest.mark.parametrize("value", NASTY)
def test_shell_values_arrive_verbatim(tmp_path, value):
    run_dir = tmp_path / f"run {value[:3]}"
    cfg = GpuctlConfig.model_validate({"env": {"GPUCTL_PROBE": value}})
    spec = BundleSpec(
        run_id="r",
        run_dir=str(run_dir),
        nodes=[BundleNode("localhost", 1)],
        python="python3",
        setup=f"printf %s {shlex.quote(value)} > setup.out",
    )
    render_bundle(cfg, spec, run_dir)
    launch = (run_dir / "launch.sh").read_text()
    # Run only the preamble: cd, exports, setup; stop before the launcher.
    preamble = launch.split("MASTER_PORT=")[0] + 'printf %s "$GPUCTL_PROBE" > env.out\n'
    (run_dir / "pre.sh").write_text(preamble)
    subprocess.run(["bash", str(run_dir / "pre.sh")], check=True, timeout=30)
    assert (run_dir / "env.out").read_text() == value
    assert (run_dir / "setup.out").read_text() == value
    assert not Path("/tmp/gpuctl-pwned").exists()


def test_template_override_beside_config(project):
    (project / "gpuctl.yaml").write_text("train: {max_steps: 5}\n")
    (project / "templates").mkdir()
    (project / "templates" / "hostfile.j2").write_text(
        "{% for n in nodes %}{{ n.host }} slots={{ n.slots }} # mine\n{% endfor %}"
    )
    assert runner.invoke(app, ["render", "-o", "b"]).exit_code == 0
    assert (project / "b" / "hostfile").read_text() == "localhost slots=3 # mine\n"


def test_broken_template_override_is_one_line(project):
    (project / "gpuctl.yaml").write_text("train: {max_steps: 5}\n")
    (project / "templates").mkdir()
    (project / "templates" / "ds_config.json.j2").write_text("{{ no_such_value }}")
    result = runner.invoke(app, ["render", "-o", "b"])
    assert result.exit_code == 2 and "ds_config.json.j2" in result.stderr and "Traceback" not in result.stderr


def test_local_data_file_is_shipped(project):
    (project / "corpus.txt").write_text("hello world\n" * 10)
    (project / "gpuctl.yaml").write_text("train: {data: corpus.txt}\n")
    assert runner.invoke(app, ["render", "-o", "b"]).exit_code == 0
    assert (project / "b" / "data" / "corpus.txt").read_text() == "hello world\n" * 10
    assert json.loads((project / "b" / "run.json").read_text())["train"]["data"] == "data/corpus.txt"


def test_scheduler_only_with_warmup(tmp_path):
    for warmup, has_scheduler in ((0, False), (3, True)):
        cfg = GpuctlConfig.model_validate({"train": {"warmup_steps": warmup, "max_steps": 10}})
        spec = BundleSpec(run_id="r", run_dir=str(tmp_path), nodes=[BundleNode("localhost", 3)], python="python3")
        render_bundle(cfg, spec, tmp_path)
        ds = json.loads((tmp_path / "ds_config.json").read_text())
        assert ("scheduler" in ds) is has_scheduler
        if has_scheduler:
            assert ds["scheduler"]["params"]["warmup_num_steps"] == 3
            assert ds["scheduler"]["params"]["total_num_steps"] == 10
            assert deepspeed_reads(tmp_path / "ds_config.json", 3)["train_batch_size"] == 12
