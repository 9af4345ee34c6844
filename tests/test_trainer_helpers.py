"""Shared helpers for the trainer tests: write a run dir, launch real DeepSpeed ranks on CPU.

No tests live here. The launch command is the one the node runs (docs/CONTRACTS.md):
  python -m deepspeed.launcher.runner --num_gpus N --no_local_rank --master_port P \
      --module trainer run.json
with cwd = the run dir, DS_ACCELERATOR=cpu, OMP_NUM_THREADS=1, PYTHONPATH = the repo root.
With no hostfile the runner launches locally and sets master_addr 127.0.0.1 itself; the CPU
accelerator accepts any --num_gpus, so no --no_ssh_check / --master_addr is needed here.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO, free_port  # free_port: also the benchmarks' h.free_port()


def ds_config(
    micro_batch: int,
    grad_accum: int,
    world: int,
    precision: str = "fp32",
    offload: bool = True,
    lr: float = 1e-3,
    stage: int = 2,
    scheduler: dict | None = None,
) -> dict:
    """A ds_config like the rendered one: AdamW, ZeRO-2, CPU offload (or torch Adam without)."""
    params = {"lr": lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0}
    if not offload:
        params["torch_adam"] = True
    zero = {"stage": stage, "overlap_comm": False, "contiguous_gradients": True}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    config = {
        "train_batch_size": micro_batch * grad_accum * world,
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**6,
        "optimizer": {"type": "AdamW", "params": params},
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "wall_clock_breakdown": False,
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16", "loss_scale": 0, "initial_scale_power": 16},
    }
    if scheduler:
        config["scheduler"] = scheduler
    return config


def make_run_dir(
    path: Path,
    world: int,
    grad_accum: int,
    micro_batch: int = 1,
    precision: str = "fp32",
    offload: bool = True,
    ds_extra: dict | None = None,
    **train,
) -> Path:
    """Write run.json + ds_config.json into path; train overrides run.json's train block."""
    path.mkdir(parents=True, exist_ok=True)
    block = {
        "model": "tiny",
        "tokenizer": None,
        "data": "sample",
        "seq_len": 64,
        "micro_batch": micro_batch,
        "grad_accum": grad_accum,
        "precision": precision,
        "zero_stage": 2,
        "offload_optimizer": "cpu" if offload else "none",
        "lr": 1e-3,
        "warmup_steps": 0,
        "max_steps": 4,
        "checkpoint_every": 0,
        "keep_local": 2,
        "seed": 1234,
        "gradient_checkpointing": False,
        "log_every": 1,
    }
    storage = train.pop("storage", None)
    resume = train.pop("resume", None)
    block.update(train)
    config = ds_config(micro_batch, grad_accum, world, precision, offload, block["lr"])
    config.update(ds_extra or {})
    (path / "ds_config.json").write_text(json.dumps(config, indent=2))
    run = {
        "run_id": path.name,
        "ds_config": "ds_config.json",
        "num_nodes": 1,
        "train": block,
        "storage": storage,
        "resume": resume,
    }
    (path / "run.json").write_text(json.dumps(run, indent=2))
    return path


def rank_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def launch_command(world: int, port: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "deepspeed.launcher.runner",
        "--num_gpus",
        str(world),
        "--no_local_rank",
        "--master_port",
        str(port),
        "--module",
        "trainer",
        "run.json",
    ]


def launch(run_dir: Path, world: int, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run the trainer with `world` CPU ranks; output goes to run_dir/job.log (as on a node).

    The launcher runs in its own session; on timeout the whole group (launcher + ranks) is
    killed, so no rank outlives the test.
    """
    log = run_dir / "job.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            launch_command(world, free_port()),
            cwd=run_dir,
            env=rank_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise AssertionError(f"trainer timed out after {timeout}s:\n{log.read_text()[-3000:]}") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, log.read_text())


def torchrun(cwd: Path, nproc: int, *args: str, timeout: float = 240) -> str:
    """`torchrun --standalone --nproc_per_node N ARGS` with CPU ranks, in its own session (the whole
    group is killed on timeout, so no rank outlives the test); its output, once it exited 0."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *args]
    proc = subprocess.Popen(
        argv,
        cwd=cwd,
        env=rank_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    assert proc.returncode == 0, out[-3000:]
    return out


def losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {rec["step"]: rec["loss"] for rec in map(json.loads, lines)}


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())
