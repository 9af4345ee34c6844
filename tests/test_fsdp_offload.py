"""train.strategy fsdp with offload_optimizer cpu: FSDP2's CPUOffloadPolicy keeps the sharded gradients on the
host, and clip_grad_norm_ all-reduces them as CPU DTensors. On GPUs an NCCL-only group has no backend for that
("No backend type associated with device type cpu", pytorch#148532): the group is device-mapped
(`cpu:gloo,cuda:nccl`). CPU ranks take the same path with `cpu:gloo` (FSDP2 accepts CPUOffloadPolicy on a CPU
mesh when unpinned; pinning needs an accelerator), so the offload + clipping step runs here for real."""

from __future__ import annotations

import pytest

from tests import test_trainer_helpers as h
from tests.test_fsdp_e2e import torchrun
from trainer.distributed import group_backend


def test_offload_maps_cpu_tensors_to_gloo_beside_the_accelerator_backend():
    assert group_backend("cuda", "nccl", cpu_offload=True) == "cpu:gloo,cuda:nccl"
    assert group_backend("cpu", "ccl", cpu_offload=True) == "cpu:gloo"
    assert group_backend("cuda", "nccl", cpu_offload=False) == "nccl"
    assert group_backend("cpu", "ccl", cpu_offload=False) == "gloo"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fsdp_offload_clips_and_steps_on_a_device_mapped_group(tmp_path):
    run_dir = h.make_run_dir(tmp_path / "run", world=2, grad_accum=1, max_steps=2, offload=True, strategy="fsdp")
    proc = torchrun(run_dir, 2, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "fsdp: CPU offload (pageable), process group cpu:gloo" in proc.stdout, proc.stdout[-3000:]
    losses = h.losses(run_dir)
    assert sorted(losses) == [1, 2] and all(loss == loss for loss in losses.values()), losses
