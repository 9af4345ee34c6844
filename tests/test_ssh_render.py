"""The multi-node bundle for SSH clusters, checked against DeepSpeed 0.19.8's own launcher code."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import pytest

from provision.core import state
from provision.core.config import GpuctlConfig
from provision.core.errors import ConfigError
from provision.flows import job
from provision.flows.render import rank_env, render_bundle


def two_node_cluster(gpu: str | None, workdir: str = "/home/u/gpuctl") -> state.ClusterRecord:
    nodes = [
        state.NodeRecord(
            host=f"10.0.0.{i}",
            address=f"10.0.0.{i}",
            port=2200 + i,
            user="u",
            slots=3,
            accelerator="cuda" if gpu else "cpu",
            gpu_name=gpu,
            workdir=workdir,
        )
        for i in (1, 2)
    ]
    return state.ClusterRecord(name="c", provider="ssh", nodes=nodes, python="/opt/py/bin/python")


def cfg_with(env: dict | None = None) -> GpuctlConfig:
    return GpuctlConfig.model_validate(
        {"provider": {"kind": "ssh", "hosts": ["u@10.0.0.1:2201", "u@10.0.0.2:2202"]}, "env": env or {}}
    )


@pytest.mark.parametrize(
    "gpu, expect",
    [
        ("NVIDIA GeForce RTX 4090", True),
        ("NVIDIA GeForce RTX 4070 Ti", True),
        ("NVIDIA GeForce RTX 4080 SUPER", True),
        ("NVIDIA A100-SXM4-80GB", False),
        ("NVIDIA GeForce RTX 3090", False),
        (None, False),
    ],
)
def test_rtx40_nccl_defaults(gpu, expect):
    spec = job.bundle_spec(cfg_with(), two_node_cluster(gpu), "r")
    env = rank_env(cfg_with(), spec)
    assert (env.get("NCCL_P2P_DISABLE") == "1" and env.get("NCCL_IB_DISABLE") == "1") is expect
    overridden = rank_env(cfg_with({"NCCL_P2P_DISABLE": "0", "NCCL_IB_DISABLE": "0"}), spec)
    assert overridden["NCCL_P2P_DISABLE"] == "0" and overridden["NCCL_IB_DISABLE"] == "0"


def test_ssh_multinode_bundle_drives_deepspeeds_pdsh_runner(tmp_path, monkeypatch):
    """Feed the rendered hostfile, launcher flags and .deepspeed_env through DeepSpeed's runner
    code paths (parse_args, fetch_hostfile, PDSHRunner.get_cmd) and check the pdsh command."""
    from deepspeed.launcher import runner as ds
    from deepspeed.launcher.multinode_runner import PDSHRunner

    cluster = two_node_cluster("NVIDIA GeForce RTX 4090")
    cfg = cfg_with({"HF_HOME": "/data/hf cache", "AWS_REGION": "eu-west-1"})
    spec = job.bundle_spec(cfg, cluster, "r1")
    assert spec.run_dir == "/home/u/gpuctl/runs/r1" and spec.master_addr == "10.0.0.1"
    assert spec.ssh_config == "/home/u/gpuctl/ssh/config"
    spec.run_dir = str(tmp_path)
    render_bundle(cfg, spec, tmp_path)

    launch = (tmp_path / "launch.sh").read_text()
    assert "export PDSH_RCMD_TYPE=ssh" in launch
    assert "export PDSH_SSH_ARGS_APPEND='-F /home/u/gpuctl/ssh/config'" in launch
    line = next(text for text in launch.splitlines() if "deepspeed.launcher.runner" in text)
    argv = shlex.split(line.split(" &")[0].replace('"$MASTER_PORT"', "29500"))
    assert "--ssh_port" not in argv  # ports differ per node: they come from the ssh config
    args = ds.parse_args(argv[argv.index("deepspeed.launcher.runner") + 1 :])
    assert args.launcher == "pdsh" and args.no_ssh_check and args.master_addr == "10.0.0.1"

    monkeypatch.chdir(tmp_path)
    pool = ds.fetch_hostfile(args.hostfile)
    assert dict(pool) == {"10.0.0.1": 3, "10.0.0.2": 3}
    resources = ds.parse_inclusion_exclusion(pool, "", "")
    pdsh = PDSHRunner(args, ds.encode_world_info(resources))
    for raw in (tmp_path / ".deepspeed_env").read_text().splitlines(keepends=True):
        key, val = raw.split("=", maxsplit=1)  # exactly how runner.main reads the file
        pdsh.add_export(key, val)
    env = {"PDSH_SSH_ARGS_APPEND": "-F /home/u/gpuctl/ssh/config"}
    cmd, _kill, env = pdsh.get_cmd(env, resources)
    assert cmd[:5] == ["pdsh", "-S", "-f", "1024", "-w"] and cmd[5] == "10.0.0.1,10.0.0.2"
    assert env["PDSH_RCMD_TYPE"] == "ssh" and env["PDSH_SSH_ARGS_APPEND"] == "-F /home/u/gpuctl/ssh/config"
    exports = cmd[6]
    for expected in (
        "export NCCL_P2P_DISABLE=1;",
        "export NCCL_IB_DISABLE=1;",
        "export AWS_REGION=eu-west-1;",
        'export HF_HOME="/data/hf cache";',
    ):
        assert expected in exports
    assert f"cd {os.path.abspath('.')};" in cmd


def test_unsafe_env_values_are_refused_for_multinode(tmp_path):
    cfg = cfg_with({"WANDB_NAME": 'say "hi"'})
    spec = job.bundle_spec(cfg, two_node_cluster(None), "r")
    with pytest.raises(ConfigError, match="multi-node launcher cannot pass"):
        render_bundle(cfg, spec, tmp_path)


def test_single_node_bundle_has_no_pdsh(tmp_path):
    cluster = two_node_cluster(None)
    cluster.nodes = cluster.nodes[:1]
    cfg = GpuctlConfig.model_validate({"provider": {"kind": "ssh", "hosts": ["u@10.0.0.1:2201"]}})
    spec = job.bundle_spec(cfg, cluster, "r")
    render_bundle(cfg, spec, tmp_path)
    launch = Path(tmp_path / "launch.sh").read_text()
    assert "PDSH" not in launch and "--launcher" not in launch and "--no_ssh_check" in launch
