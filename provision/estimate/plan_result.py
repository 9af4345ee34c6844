"""What `gpuctl plan` answers: per-rank GPU memory and the verdict (PlanResult).

Its own module, so what reads a result (plan.py, explain.py, the CLI views) imports it and the
imports run one way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from provision.estimate.hardware import GB, GpuSpec, ModelDims
from provision.estimate.node_terms import NodeRequirements
from provision.estimate.plan_input import PlanInput


@dataclass(frozen=True)
class GpuMemory:
    """Per-rank GPU memory, GB."""

    weights_gb: float
    grads_gb: float
    optimizer_gb: float
    buffers_gb: float
    activations_gb: float  # the one that applies (checkpointing on or off)
    activations_ckpt_gb: float
    activations_full_gb: float
    fragmentation_gb: float
    cuda_context_gb: float
    model_states_bytes: int  # = DeepSpeed's estimator for 16-bit ZeRO-2/3

    @property
    def total_gb(self) -> float:
        return (
            self.model_states_bytes / GB
            + self.buffers_gb
            + self.activations_gb
            + self.fragmentation_gb
            + self.cuda_context_gb
        )


@dataclass(frozen=True)
class PlanResult:
    input: PlanInput
    model: ModelDims
    params: int
    gpu: GpuSpec
    gpu_capacity_gb: float
    memory: GpuMemory
    node: NodeRequirements  # host RAM (load, steady, resume) and disk per node, term by term
    collective_timeout_s: int  # the process group's timeout the trainer gets (provision.estimate.node)
    ds_host_ram_gb: float  # per node, DeepSpeed's estimate_zero*_model_states_mem_needs (x1.5 buffer factor)
    host_adam_states_gb: float  # per node: fp32 master + m + v + grads (+ fp16 params), no buffer factor
    fits: bool
    flops_per_token: float
    tokens_per_s_low: float
    tokens_per_s_high: float
    flop_ceiling_tokens_per_s: float  # 100% of peak, 6 x params, no recompute
    why: list[str] = field(default_factory=list)
    closest: PlanResult | None = None  # cheapest change that fits, when this does not
    closest_changes: list[str] = field(default_factory=list)

    @property
    def gpu_gb_per_rank(self) -> float:
        return self.memory.total_gb

    @property
    def host_ram_gb(self) -> float:
        """Host RAM a node needs (the worst of load, steady, resume, plus the OS reserve)."""
        return self.node.ram_gb
