"""The process group: which backend, joining it, leaving it (trainer.loop's setup and end of run)."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import deepspeed
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from trainer.config import DistEnv, TrainerError


def start_distributed(env: DistEnv, precision: str, timeout_s: int, cpu_offload: bool = False) -> None:
    """Join the process group: gloo for CPU ranks, the accelerator's backend (NCCL) otherwise, and a
    device-mapped group where FSDP offloads to the host (see group_backend). Every collective may wait
    timeout_s (run.json's collective_timeout_s) for the slowest rank."""
    accel = get_accelerator()
    if precision == "fp16" and accel.device_name() == "cpu" and not accel.is_fp16_supported():
        raise TrainerError(
            "fp16 is not supported by DeepSpeed on this CPU (no AVX512-FP16/AMX-FP16); "
            "use precision bf16 or fp32 for CPU runs"
        )
    if accel.device_name() != "cpu":
        accel.set_device(env.local_rank)  # before the first collective (the data barrier) under NCCL
    deepspeed.init_distributed(dist_backend=dist_backend(cpu_offload), timeout=timedelta(seconds=timeout_s))
    if accel.device_name() == "cpu":
        dist.barrier()  # past this, every rank has mapped every other rank's shm buffer
        unlink_shm_buffer(env.rank)


def unlink_shm_buffer(rank: int) -> None:
    """DeepSpeed's CPU allreduce never unlinks its /dev/shm buffer (69 MB a rank, left behind by
    every run, killed or not). Once all ranks have mapped it the name can go; the mapping stays."""
    name = f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR')}_{os.environ.get('MASTER_PORT')}_{rank}"
    Path("/dev/shm", name).unlink(missing_ok=True)


def leave_process_group() -> None:
    """End of training: all ranks meet once more, then each leaves the group. What follows (uploads,
    summary.json) runs without collectives, so no rank sits in one while another uploads for an hour."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def dist_backend(cpu_offload: bool = False) -> str:
    accel = get_accelerator()
    return group_backend(accel.device_name(), accel.communication_backend_name(), cpu_offload)


def group_backend(device: str, accel_backend: str, cpu_offload: bool) -> str:
    """The process group's backend. FSDP's CPUOffloadPolicy keeps the sharded gradients on the host, so
    clip_grad_norm_ all-reduces CPU DTensors: an NCCL-only group has no backend for them ("No backend type
    associated with device type cpu", pytorch#148532). With offload the group maps devices to backends
    (torchtune's `cpu:gloo,cuda:nccl`); CPU ranks get the same device-mapped shape, `cpu:gloo`."""
    if not cpu_offload:
        return "gloo" if device == "cpu" else accel_backend
    return "cpu:gloo" if device == "cpu" else f"cpu:gloo,{device}:{accel_backend}"
