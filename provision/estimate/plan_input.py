"""What `gpuctl plan` is asked: one training configuration (PlanInput), checked on construction.

Its own module, so what plans from it (plan.py, node.py, node_terms.py, fsdp_node.py) imports it
and the imports run one way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from provision.estimate.hardware import KNOWN_MODELS, ModelDims, PlanError, find_gpu

# Input bounds: far beyond any real run, tight enough that no figure overflows or turns NaN.
INT_LIMITS = {
    "gpus_per_node": 64,
    "nodes": 4096,
    "micro_batch": 65536,
    "seq_len": 1 << 22,
    "reduce_bucket_size": 1 << 40,
    "grad_accum": 4096,  # the config's own bound
    "keep_local": 1000,
}
FLOAT_LIMITS = {
    "gpu_mem_gb": (0.001, 4096.0),
    "cuda_context_gb": (0.0, 1024.0),
    "fragmentation": (0.0, 10.0),
    "additional_buffer_factor": (0.0, 100.0),
    "mfu_low": (0.0, 1.0),
    "mfu_high": (0.0, 1.0),
}


@dataclass(frozen=True)
class PlanInput:
    model: str | ModelDims = "deepseek-7b"  # a KNOWN_MODELS name or explicit dims
    strategy: Literal["deepspeed", "fsdp"] = "deepspeed"  # host RAM terms (GPU figures: provision.estimate.fsdp)
    gpus_per_node: int = 3
    nodes: int = 1
    zero_stage: int = 2
    offload_optimizer: Literal["none", "cpu"] = "cpu"
    offload_param: Literal["none", "cpu"] = "none"  # ZeRO-3 only
    micro_batch: int = 1
    seq_len: int = 2048
    gradient_checkpointing: bool = True
    precision: Literal["fp16", "bf16", "fp32"] = "fp16"
    gpu: str = "RTX 4090"
    gpu_mem_gb: float | None = None  # None: the GPU table's figure
    attention: Literal["sdpa", "eager"] = "sdpa"
    reduce_bucket_size: int = 200_000_000  # elements; gpuctl's ds_config template (DeepSpeed's default: 5e8)
    overlap_comm: bool | None = True  # template: on for CUDA (double bucket); None: DeepSpeed's default
    cuda_context_gb: float = 1.0  # CUDA context + cuBLAS workspace + NCCL buffers
    fragmentation: float = 0.10  # caching-allocator slack, fraction of allocated bytes
    additional_buffer_factor: float = 1.5  # DeepSpeed estimator default
    zero_init: bool = True  # ZeRO-3 host estimate: model built under deepspeed.zero.Init
    mfu_low: float = 0.25
    mfu_high: float = 0.45
    # host RAM and disk (provision.estimate.node)
    grad_accum: int = 4  # > 1 adds DeepSpeed's per-tensor accumulation buffers on the host
    keep_local: int = 2  # checkpoints kept on the node's disk
    round_robin_gradients: bool = True  # gpuctl's ds_config template (with offload)
    pinning: Literal["exact", "off", "pow2"] = "exact"  # the trainer: exact-size or off; pow2 = torch's default
    resume_mmap: bool = True  # the trainer memory-maps checkpoint files at resume
    data_bytes: int | None = None  # the dataset file, when known (disk, tokenize time)

    def __post_init__(self) -> None:
        if isinstance(self.model, str) and self.model not in KNOWN_MODELS:
            raise PlanError(f"plan: unknown model {self.model!r}; known: {', '.join(KNOWN_MODELS)} (or ModelDims)")
        for name in (
            "gpus_per_node",
            "nodes",
            "micro_batch",
            "seq_len",
            "reduce_bucket_size",
            "grad_accum",
            "keep_local",
        ):
            if getattr(self, name) < 1:
                raise PlanError(f"plan: {name} must be >= 1, got {getattr(self, name)}")
            if getattr(self, name) > INT_LIMITS[name]:
                raise PlanError(f"plan: {name} must be <= {INT_LIMITS[name]:,}, got {getattr(self, name)}")
        for name, (low, high) in FLOAT_LIMITS.items():
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and low <= value <= high):
                raise PlanError(f"plan: {name} must be a number from {low:g} to {high:g}, got {value}")
        for name, allowed in {
            "zero_stage": (0, 1, 2, 3),
            "offload_optimizer": ("none", "cpu"),
            "offload_param": ("none", "cpu"),
            "precision": ("fp16", "bf16", "fp32"),
            "attention": ("sdpa", "eager"),
            "pinning": ("exact", "off", "pow2"),
            "strategy": ("deepspeed", "fsdp"),
        }.items():
            if getattr(self, name) not in allowed:
                raise PlanError(f"plan: {name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.offload_optimizer == "cpu" and self.zero_stage == 0:
            raise PlanError("plan: offload_optimizer=cpu needs ZeRO stage >= 1")
        if self.offload_param == "cpu" and (self.zero_stage != 3 or self.offload_optimizer != "cpu"):
            raise PlanError("plan: offload_param=cpu needs zero_stage=3 and offload_optimizer=cpu")
        if not 0 < self.mfu_low <= self.mfu_high <= 1:
            raise PlanError("plan: need 0 < mfu_low <= mfu_high <= 1")
        find_gpu(self.gpu)

    @property
    def dims(self) -> ModelDims:
        return self.model if isinstance(self.model, ModelDims) else KNOWN_MODELS[self.model]

    @property
    def total_gpus(self) -> int:
        return self.gpus_per_node * self.nodes
