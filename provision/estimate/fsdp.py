"""`gpuctl plan --strategy fsdp`: per-rank memory of PyTorch FSDP2 as the trainer runs it (pure Python).

trainer/fsdp_engine.py: fp32 master weights, fully_shard on every decoder layer and on the root, AdamW.
Per rank (N ranks, P params, GB = 10**9 bytes):
* sharded states, 16 B/param / N: fp32 weights 4, fp32 gradients 4 (reduce-scatter in fp32), Adam m + v 8.
  FSDP2 pads each parameter's dim 0 up to a multiple of N, so a rank holds ceil(rows / N) rows of each.
  With offload cpu (CPUOffloadPolicy) all three live in host RAM and the optimizer step runs there.
* gathered: the unsharded parameters in compute dtype (bf16: 2 B, fp32: 4 B) of the unit running plus the
  one prefetched (2 decoder layers), and the root unit (embedding, final norm, lm_head), which FSDP2 keeps
  gathered from forward to backward; in backward the same units' unsharded gradients before reduce-scatter.
* activations: plan's formula (provision.estimate.plan, Korthikanti et al. re-done for Llama), the same
  for both engines; fragmentation and CUDA context as plan has them.
DeepSpeed ZeRO-2 in comparison keeps the full 16-bit weights on every rank: FSDP wins when weights dominate,
ZeRO-2 + offload when the optimizer does and a rank cannot hold one 16-bit copy of the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from provision.estimate.fsdp_node import shard_numels
from provision.estimate.hardware import GB, ModelDims
from provision.estimate.plan import _activation_bytes
from provision.estimate.plan_input import PlanInput
from provision.estimate.plan_result import PlanResult


@dataclass(frozen=True)
class FsdpMemory:
    """Per-rank FSDP2 memory, GB; the sharded states are on the GPU, or the host with offload."""

    params_gb: float  # this rank's shard of the fp32 weights
    grads_gb: float  # its shard of the fp32 gradients
    optimizer_gb: float  # its shard of Adam's m and v
    gathered_gb: float  # unsharded compute-dtype params + their gradients of the units in flight
    activations_gb: float
    fragmentation_gb: float
    cuda_context_gb: float
    offloaded: bool

    @property
    def states_gb(self) -> float:
        return self.params_gb + self.grads_gb + self.optimizer_gb

    @property
    def gpu_gb(self) -> float:
        on_gpu = 0.0 if self.offloaded else self.states_gb
        return on_gpu + self.gathered_gb + self.activations_gb + self.fragmentation_gb + self.cuda_context_gb

    @property
    def host_gb(self) -> float:
        """Host RAM this rank's offloaded states take (0 without offload)."""
        return self.states_gb if self.offloaded else 0.0


def sharded_numel(m: ModelDims, world: int) -> int:
    """Elements of one rank's shards."""
    return sum(shard_numels(m, world))


def fsdp_memory(inp: PlanInput) -> FsdpMemory:
    m, world = inp.dims, inp.total_gpus
    shard = sharded_numel(m, world)
    compute_b = 4 if inp.precision == "fp32" else 2
    kv_dim = (m.kv_heads or m.heads) * (m.hidden // m.heads)
    layer = 2 * m.hidden * m.hidden + 2 * m.hidden * kv_dim + 3 * m.hidden * m.intermediate + 2 * m.hidden
    root = m.vocab * m.hidden * (1 if m.tied_embeddings else 2) + m.hidden
    gathered = compute_b * (2 * layer + root) * 2  # params, and their unsharded grads in backward
    act_ckpt, act_full = _activation_bytes(inp, m)
    act = act_ckpt if inp.gradient_checkpointing else act_full
    offloaded = inp.offload_optimizer == "cpu"
    states = 16 * shard
    frag = inp.fragmentation * ((0 if offloaded else states) + gathered + act)
    return FsdpMemory(
        params_gb=4 * shard / GB,
        grads_gb=4 * shard / GB,
        optimizer_gb=8 * shard / GB,
        gathered_gb=gathered / GB,
        activations_gb=act / GB,
        fragmentation_gb=frag / GB,
        cuda_context_gb=inp.cuda_context_gb,
        offloaded=offloaded,
    )


def better_strategy(ds: PlanResult, fsdp: FsdpMemory) -> tuple[str, str]:
    """Which engine fits the GPUs better for this config, and one line saying why."""
    cap = ds.gpu_capacity_gb
    ds_gb, fs_gb = ds.memory.total_gb, fsdp.gpu_gb
    fits = {"deepspeed": ds_gb <= cap, "fsdp": fs_gb <= cap}
    if fits["fsdp"] != fits["deepspeed"]:
        name = "fsdp" if fits["fsdp"] else "deepspeed"
        other = "deepspeed" if name == "fsdp" else "fsdp"
        gb = {"deepspeed": ds_gb, "fsdp": fs_gb}
        return name, f"{name} fits ({gb[name]:.1f} of {cap:g} GB per GPU), {other} does not ({gb[other]:.1f} GB)"
    name = "fsdp" if fs_gb < ds_gb else "deepspeed"
    verdict = "both fit" if fits["fsdp"] else "neither fits"
    return name, (
        f"{verdict}: deepspeed ZeRO-{ds.input.zero_stage} {ds_gb:.1f} GB, fsdp {fs_gb:.1f} GB per GPU "
        f"(of {cap:g}); {name} leaves more room"
    )


def fsdp_to_json(ds: PlanResult, fsdp: FsdpMemory) -> dict[str, Any]:
    best, why = better_strategy(ds, fsdp)
    return {
        "params_gb": round(fsdp.params_gb, 4),
        "grads_gb": round(fsdp.grads_gb, 4),
        "optimizer_gb": round(fsdp.optimizer_gb, 4),
        "gathered_gb": round(fsdp.gathered_gb, 4),
        "activations_gb": round(fsdp.activations_gb, 4),
        "fragmentation_gb": round(fsdp.fragmentation_gb, 4),
        "cuda_context_gb": fsdp.cuda_context_gb,
        "offloaded": fsdp.offloaded,
        "gpu_gb_per_rank": round(fsdp.gpu_gb, 4),
        "host_gb_per_rank": round(fsdp.host_gb, 4),
        "fits": fsdp.gpu_gb <= ds.gpu_capacity_gb,
        "better_strategy": best,
        "why": why,
    }
