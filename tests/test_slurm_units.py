"""provider slurm's pieces without a Slurm (the runs themselves: tests/test_slurm.py, two slurmd): the
job's options, what gpuctl reads back from Slurm, a restart's resume, and trainer/slurm_node.py, each
node's launcher, whose argv DeepSpeed's per-node launcher and torchrun's own parsers read back, started
by the bundle's launch.sh through one srun step."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from unittest import mock

import pytest
from hypothesis import given
from hypothesis import strategies as st

from provision.core.config import GpuctlConfig
from provision.core.provider_config import SlurmProvider
from provision.flows.render import BundleNode, BundleSpec, render_bundle
from provision.providers.slurm import SlurmNode, gres_gpus, job_options, site_gpu_request
from provision.transport.remote import CommandResult, Node
from trainer import slurm_node

TAIL = ["--master_port", "29511", "--module", "trainer", "run.json"]
TWO_NODES = {"SLURM_JOB_NUM_NODES": "2", "GPUCTL_SLURM_HOSTS": "gpu-a gpu-b", "MASTER_ADDR": "10.1.0.7"}


def deepspeed_reads(argv: list[str]):
    """What deepspeed.launcher.launch's own parser makes of the argv after `-m deepspeed.launcher.launch`."""
    from deepspeed.launcher import launch

    with mock.patch.object(sys, "argv", ["launch", *argv]):
        return launch.parse_args()


def test_deepspeed_node_gets_its_node_rank_and_slurms_gpus():
    env = {**TWO_NODES, "SLURM_NODEID": "1", "CUDA_VISIBLE_DEVICES": "2,3"}
    argv, _ = slurm_node.launcher(["deepspeed", "2", *TAIL], env)
    assert argv[:4] == [sys.executable, "-u", "-m", "deepspeed.launcher.launch"]
    args = deepspeed_reads(argv[4:])
    assert (args.node_rank, args.master_addr, args.master_port) == (1, "10.1.0.7", 29511)
    assert args.module and args.no_local_rank and args.training_script == "trainer"
    world = json.loads(base64.urlsafe_b64decode(args.world_info))
    # DeepSpeed's launcher counts ranks in the dict's order: node 0's first
    assert list(world) == ["gpu-a", "gpu-b"] and world["gpu-b"] == [2, 3] and len(world["gpu-a"]) == 2


def test_cpu_ranks_ignore_visible_devices():
    env = {**TWO_NODES, "SLURM_NODEID": "0", "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "0"}
    assert slurm_node.device_ids(env, 3) == [0, 1, 2]


def test_fsdp_node_is_torchrun_at_slurms_node_rank():
    env = {**TWO_NODES, "SLURM_NODEID": "1"}
    argv, run_env = slurm_node.launcher(["fsdp", "3", *TAIL], env)
    assert argv[:4] == [sys.executable, "-u", "-m", "torch.distributed.run"]
    from torch.distributed.run import parse_args

    args = parse_args(argv[4:])
    assert (args.nnodes, args.node_rank, args.nproc_per_node) == ("2", 1, "3")
    assert (args.master_addr, args.master_port, args.training_script) == ("10.1.0.7", 29511, "trainer")
    assert run_env["GPUCTL_OMP_FROM_TORCHRUN"] == "1"  # each rank sizes its own threads
    assert (
        "GPUCTL_OMP_FROM_TORCHRUN" not in slurm_node.launcher(["fsdp", "3", *TAIL], {**env, "OMP_NUM_THREADS": "4"})[1]
    )


@pytest.mark.parametrize(
    ("argv", "env", "says"),
    [
        (["deepspeed", "two", *TAIL], TWO_NODES, "usage:"),
        (["horovod", "2", *TAIL], TWO_NODES, "usage:"),
        (["deepspeed", "2", "--module"], TWO_NODES, "usage:"),
        (["deepspeed", "2", *TAIL], {**TWO_NODES, "SLURM_NODEID": "2"}, "does not match the job's 2 node(s)"),
        (["deepspeed", "2", *TAIL], {**TWO_NODES, "GPUCTL_SLURM_HOSTS": "gpu-a"}, "does not match"),
        (["deepspeed", "2", *TAIL], {**TWO_NODES, "CUDA_VISIBLE_DEVICES": "0"}, "gave this node 1 GPU(s)"),
    ],
)
def test_a_wrong_shape_is_one_line(argv, env, says):
    with pytest.raises(SystemExit) as stop:
        slurm_node.launcher(argv, env)
    assert says in str(stop.value) and "\n" not in str(stop.value)


@pytest.mark.parametrize("strategy", ["deepspeed", "fsdp"])
def test_slurm_bundle_starts_one_launcher_per_node(tmp_path, strategy):
    cfg = GpuctlConfig.model_validate({"train": {"strategy": strategy, "grad_accum": 2}})
    nodes = [BundleNode(f"node{i}", 2) for i in range(3)]  # placeholders: Slurm picks the nodes
    spec = BundleSpec(
        run_id="r", run_dir=str(tmp_path), nodes=nodes, python="python3", scheduler="slurm", ssh_config="/x"
    )
    render_bundle(cfg, spec, tmp_path)
    launch = (tmp_path / "launch.sh").read_text()
    srun = "srun --export=ALL --nodes=3 --ntasks-per-node=1 --kill-on-bad-exit=1 python3 -u -m trainer.slurm_node"
    assert f"{srun} {strategy} 2" in launch
    assert "deepspeed.launcher.runner" not in launch and not (tmp_path / "torchrun.sh").exists()
    assert "PDSH_SSH_ARGS_APPEND" not in launch  # no pdsh: srun reaches the nodes
    assert json.loads((tmp_path / "ds_config.json").read_text())["train_batch_size"] == 12  # 6 ranks x 1 x 2
    assert json.loads((tmp_path / "run.json").read_text())["num_nodes"] == 3
    subprocess.run(["bash", "-n", str(tmp_path / "launch.sh")], check=True)


def test_the_job_asks_for_the_walltime_warning_and_names_what_travels():
    prov = SlurmProvider(
        workdir="/shared/x", partition="gpu", gpus_per_node=4, time="2:00:00", save_before_walltime_s=600
    )
    opts = job_options(prov)
    assert "--signal=USR1@600" in opts and opts[opts.index("--gpus-per-node") + 1] == "4"
    assert not any(o.startswith("--export") and "=" in o.split("=", 1)[1] for o in opts)  # names, never values


def test_the_job_asks_for_gpus_the_way_the_site_does():
    assert site_gpu_request("AuthType = auth/munge\nSelectType              = select/cons_tres\n") == "gpus-per-node"
    assert site_gpu_request("SelectType = select/cons_res\nSelectTypeParameters = CR_Core\n") == "gres"
    assert site_gpu_request("") == "gres"  # an old or unreadable config: --gres is what every Slurm knows
    prov = SlurmProvider(workdir="/shared/x", gpus_per_node=2, gpu_request="gres")
    opts = job_options(prov)
    assert opts[opts.index("--gres") + 1] == "gpu:2" and "--gpus-per-node" not in opts
    assert [gres_gpus(g) for g in ("gpu:4", "gpu:a100:4(S:0-1)", "gpu:a:2,gpu:b:2", "(null)", "mps:100")] == [
        4,
        4,
        4,
        0,
        0,
    ]


class ScriptedLogin(Node):
    """A login node whose commands answer from `answers` (argv[0] -> (rc, stdout, stderr))."""

    def __init__(self, answers: dict[str, tuple[int, str, str]]):
        self.answers = answers

    def _execute(self, argv, timeout, stream, stdin) -> CommandResult:
        return CommandResult(*self.answers[argv[0]])


def test_a_job_scontrol_forgot_reads_its_end_from_sacct():
    forgot = (1, "", "slurm_load_jobs error: Invalid job id specified\n")
    node = SlurmNode(ScriptedLogin({"scontrol": forgot, "sacct": (0, "PREEMPTED\n", "")}), [])
    assert node.queue_state(7) == "Slurm job 7 PREEMPTED" and not node.group_alive(7)
    node = SlurmNode(ScriptedLogin({"scontrol": forgot, "sacct": (0, "CANCELLED by 0\n", "")}), [])
    assert node.queue_state(7) == "Slurm job 7 CANCELLED"
    no_accounting = (1, "", "sacct: error: Slurm accounting storage is disabled\n")
    assert SlurmNode(ScriptedLogin({"scontrol": forgot, "sacct": no_accounting}), []).queue_state(7) is None


class CannedLogin(Node):
    """A login node whose scontrol prints `out` (what a hostile or odd Slurm might)."""

    def __init__(self, out: str):
        self.out = out

    def _execute(self, argv, timeout, stream, stdin) -> CommandResult:
        return CommandResult(0, self.out, "")


@given(st.text(max_size=300))
def test_the_queue_state_shown_is_slurms_words_only(reason):
    out = f"JobId=7 JobName=x JobState=PENDING Reason={reason} Dependency=(null)"
    shown = SlurmNode(CannedLogin(out), []).queue_state(7)
    assert shown is not None and shown.startswith("Slurm job 7 PENDING")
    assert all(ch.isprintable() and ord(ch) < 128 for ch in shown)


def test_a_restart_resumes_from_the_newest_tag_this_run_saved(tmp_path, monkeypatch):
    from trainer.config import requeued_resume

    run = tmp_path / "run"
    assert requeued_resume(run, {"url": "s3://b/x"}, None) is None  # nothing saved before the requeue: fresh
    assert requeued_resume(run, {"url": "s3://b/x"}, "step2") == "step2"  # ... or what the run resumed from
    for tag in ("step3", "step12", "step6"):
        (run / "checkpoints" / tag).mkdir(parents=True)
    assert requeued_resume(run, {"url": "s3://b/x"}, None) == "step12"  # the store falls back if incomplete
    assert requeued_resume(run, None, None) is None  # no store and no DeepSpeed `latest`
    (run / "checkpoints" / "latest").write_text("step12")
    assert requeued_resume(run, None, None) == str((run / "checkpoints").resolve())
