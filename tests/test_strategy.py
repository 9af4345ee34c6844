"""train.strategy: the config's rules for fsdp, and the torchrun bundle it renders (no ranks started)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from provision.core.config import GpuctlConfig, load_config
from provision.core.errors import ConfigError
from provision.flows.render import BundleNode, BundleSpec, render_bundle
from tests.helpers import run_gpuctl


def write(project: Path, **train) -> Path:
    path = project / "gpuctl.yaml"
    path.write_text(yaml.safe_dump({"provider": {"kind": "local"}, "train": train}))
    return path


@pytest.mark.parametrize(
    ("train", "named"),
    [
        ({"zero_stage": 3}, "zero_stage is a DeepSpeed-only key"),
        ({"tensorboard": True}, "tensorboard is a DeepSpeed-only key"),
        ({"precision": "fp16"}, "with strategy fsdp use bf16"),
    ],
)
def test_fsdp_refuses_what_only_deepspeed_does(project, train, named):
    path = write(project, strategy="fsdp", **train)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert named in str(err.value) and "train" in str(err.value)
    write(project, strategy="deepspeed", **train)  # the same keys are DeepSpeed's own: fine there
    load_config(path)


def test_the_init_templates_defaults_pass_with_fsdp(project):
    assert run_gpuctl("init", cwd=project).returncode == 0
    text = (project / "gpuctl.yaml").read_text().replace("strategy: deepspeed", "strategy: fsdp")
    (project / "gpuctl.yaml").write_text(text)
    assert load_config(project / "gpuctl.yaml").train.strategy == "fsdp"  # zero_stage 2, tensorboard false: defaults


def test_a_bad_strategy_is_one_line_without_traceback(project):
    write(project, strategy="fsdp", zero_stage=1)
    out = run_gpuctl("train", "--dry-run", cwd=project)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "zero_stage" in lines[0] and "fsdp" in lines[0], out.stderr
    write(project, strategy="megatron")
    out = run_gpuctl("train", "--dry-run", cwd=project)
    assert out.returncode != 0 and "train.strategy" in out.stderr and "Traceback" not in out.stderr


def spec(tmp_path: Path, hosts: list[str], secrets: dict[str, str] | None = None) -> BundleSpec:
    return BundleSpec(
        run_id="r1",
        run_dir=str(tmp_path / "node run"),
        nodes=[BundleNode(h, 2) for h in hosts],
        python="/usr/bin/python3",
        master_addr=hosts[0].split("@")[-1],
        ssh_config="/w/ssh/config" if len(hosts) > 1 else None,
        secrets=secrets or {},
    )


def test_one_node_renders_a_standalone_torchrun(tmp_path):
    cfg = GpuctlConfig(train={"strategy": "fsdp"})
    out = render_bundle(cfg, spec(tmp_path, ["localhost"]), tmp_path / "b")
    script = (out / "torchrun.sh").read_text()
    assert subprocess.run(["bash", "-n", str(out / "torchrun.sh")]).returncode == 0
    assert "-m torch.distributed.run --standalone --nnodes 1" in script and "--module trainer run.json" in script
    assert "ssh -F" not in script
    marker = next(line for line in script.splitlines() if "GPUCTL_OMP_FROM_TORCHRUN" in line)  # trainer.hostenv
    for preset, marked in (({}, "1"), ({"OMP_NUM_THREADS": "1"}, "")):  # the user's OMP_NUM_THREADS stays theirs
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} | preset
        echo = subprocess.run(
            ["bash", "-c", marker + '; echo "$GPUCTL_OMP_FROM_TORCHRUN"'], env=env, capture_output=True
        )
        assert echo.stdout.decode().strip() == marked
    assert f"bash '{tmp_path}/node run/torchrun.sh' --master_port" in (out / "launch.sh").read_text()
    assert "deepspeed.launcher" not in (out / "launch.sh").read_text()
    assert json.loads((out / "run.json").read_text())["train"]["strategy"] == "fsdp"


def test_two_nodes_start_one_torchrun_each_over_the_mesh(tmp_path):
    cfg = GpuctlConfig(train={"strategy": "fsdp"})
    out = render_bundle(
        cfg, spec(tmp_path, ["u@10.0.0.1", "u@10.0.0.2"], {"AWS_SECRET_ACCESS_KEY": "s3cr3t"}), tmp_path / "b"
    )
    script = (out / "torchrun.sh").read_text()
    assert subprocess.run(["bash", "-n", str(out / "torchrun.sh")]).returncode == 0
    assert (
        "torch.distributed.run --standalone" not in script
        and "--master_addr 10.0.0.1" in script
        and "SLOTS=(2 2 )" in script
    )
    # node 1 is reached by its mesh alias, and runs this same script with its node rank
    assert f"ssh -F /w/ssh/config -o BatchMode=yes 10.0.0.2 'bash '\"'\"'{tmp_path}/node run/torchrun.sh" in script
    assert '--node 1\'" $PORT"' in script
    # secrets: each rank reads its node's own 0600 file; nothing sources it into torchrun's environment
    sourced = [line for line in script.splitlines() if line.lstrip().startswith((". ", "source ", "if [ -f"))]
    assert "s3cr3t" not in script and sourced == []
