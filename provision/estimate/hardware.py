"""What `plan` knows about models and GPUs, and DeepSpeed's own ZeRO memory estimators.

GB are 10**9 bytes. The estimator functions mirror DeepSpeed 0.19's
`estimate_zero2_model_states_mem_needs` (stage_1_and_2.py) and
`estimate_zero3_model_states_mem_needs` (stage3.py) line for line (tests/test_plan.py compares).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

GB = 1e9


class PlanError(ValueError):
    """An invalid planner input (the message says which field and why)."""


@dataclass(frozen=True)
class ModelDims:
    """Llama-architecture dimensions (no biases, RMSNorm, SwiGLU MLP)."""

    name: str
    layers: int
    hidden: int
    heads: int
    intermediate: int
    vocab: int
    kv_heads: int | None = None  # None: multi-head attention (= heads)
    tied_embeddings: bool = False

    @property
    def params(self) -> int:
        kv_dim = (self.kv_heads or self.heads) * (self.hidden // self.heads)
        attn = 2 * self.hidden * self.hidden + 2 * self.hidden * kv_dim
        mlp = 3 * self.hidden * self.intermediate
        embed = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return self.layers * (attn + mlp + 2 * self.hidden) + embed + self.hidden

    @property
    def largest_layer_params(self) -> int:
        """Largest module's own params, as DeepSpeed's model_to_params counts it (one weight for Llama)."""
        return max(self.vocab * self.hidden, self.hidden * self.intermediate, self.hidden * self.hidden)

    def param_numels(self) -> list[int]:
        """Element counts in `model.parameters()` order of transformers' LlamaForCausalLM: embedding;
        per layer q, k, v, o, gate, up, down, input norm, post-attention norm; final norm; lm_head.
        DeepSpeed flattens and partitions the parameters in this order."""
        kv_dim = (self.kv_heads or self.heads) * (self.hidden // self.heads)
        h, i = self.hidden, self.intermediate
        layer = [h * h, h * kv_dim, h * kv_dim, h * h, i * h, i * h, h * i, h, h]
        head = [] if self.tied_embeddings else [self.vocab * h]
        return [self.vocab * h, *(layer * self.layers), h, *head]


_DEEPSEEK_7B = ModelDims("deepseek-7b", layers=30, hidden=4096, heads=32, intermediate=11008, vocab=102400)
KNOWN_MODELS: dict[str, ModelDims] = {
    "deepseek-7b": _DEEPSEEK_7B,
    "deepseek-ai/deepseek-llm-7b-base": _DEEPSEEK_7B,
    "tiny": ModelDims("tiny", layers=4, hidden=128, heads=4, intermediate=344, vocab=259),  # trainer: bytes + 3
}


@dataclass(frozen=True)
class GpuSpec:
    name: str
    peak_tflops_16bit: float  # dense fp16/bf16 tensor-core, fp32 accumulate
    peak_tflops_fp32: float  # plain fp32 (no TF32)
    mem_gb: float
    source: str
    bf16: bool = True  # runs bf16 at the fp16 rate (Ampere and newer); plan recommends it over fp16 then


GPU_TABLE: tuple[GpuSpec, ...] = (
    GpuSpec("RTX 4090", 165.2, 82.6, 24, "NVIDIA Ada Lovelace GPU architecture whitepaper (330.4 with sparsity)"),
    GpuSpec("H200", 989.0, 66.9, 141, "NVIDIA H200 datasheet (1,979 with sparsity; same SXM core as H100)"),
    GpuSpec("H100 PCIe", 756.0, 51.2, 80, "NVIDIA H100 datasheet, PCIe column (1,513 with sparsity)"),
    GpuSpec("H100", 989.0, 66.9, 80, "NVIDIA H100 datasheet, SXM column (1,979 with sparsity)"),
    GpuSpec("A100", 312.0, 19.5, 80, "NVIDIA A100 datasheet (624 with sparsity)"),
    GpuSpec("A10G", 125.0, 31.2, 24, "NVIDIA A10 datasheet (AWS's A10G has no separate NVIDIA figure)"),
    GpuSpec("L4", 121.0, 30.3, 24, "NVIDIA L4 datasheet (242 with sparsity)"),
)


def _norm(s: str) -> str:
    return re.sub(r"[^a-z0-9]", "", s.lower().replace("nvidia", "").replace("geforce", ""))


def find_gpu(name: str) -> GpuSpec:
    """Match a marketing or `torch.cuda.get_device_name()` name ("NVIDIA GeForce RTX 4090", "NVIDIA H200")."""
    key = _norm(name)
    for spec in GPU_TABLE:  # ordered so "H100 PCIe" is tried before "H100"
        if _norm(spec.name) in key:
            size = re.search(r"(\d+)\s*gb", name.lower())
            return replace(spec, mem_gb=float(size.group(1))) if size else spec
    known = ", ".join(s.name for s in GPU_TABLE)
    raise PlanError(f"unknown GPU {name!r}: known are {known}")


# --- DeepSpeed's estimators, mirrored formula for formula (deepspeed 0.19.8) ---------------------
def zero2_model_states_mem(
    total_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    cpu_offload: bool = True,
    additional_buffer_factor: float = 1.5,
) -> tuple[int, int]:
    """(cpu_bytes, gpu_bytes) exactly as deepspeed...stage_1_and_2.estimate_zero2_model_states_mem_needs."""
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu_mem = 2 * total_params
        cpu_mem = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:
        gpu_mem = 2 * total_params + int(18 * total_params / total_gpus)
        cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem)


def zero3_model_states_mem(
    total_params: int,
    largest_layer_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    cpu_offload: bool = True,
    cpu_offload_params: bool = True,
    zero_init: bool = True,
    additional_buffer_factor: float = 1.5,
) -> tuple[int, int, int]:
    """(cpu, gpu, largest_layer_memory) exactly as deepspeed...stage3.estimate_zero3_model_states_mem_needs."""
    total_gpus = num_nodes * num_gpus_per_node
    gpus_factor = 1 / num_nodes
    largest_layer_memory = 4 * largest_layer_params
    abf = additional_buffer_factor  # same operation order as DeepSpeed, so the int() truncation agrees
    if cpu_offload:
        states = 18 if cpu_offload_params else 16  # + 2 fp16 params when they are offloaded too
        gpu_mem = largest_layer_memory + (0 if cpu_offload_params else int(2 * total_params / total_gpus))
        if zero_init:
            cpu_mem = total_params * states * gpus_factor * abf
        else:
            cpu_mem = total_params * max(4 * num_gpus_per_node, states * gpus_factor) * abf
    else:
        gpu_mem = largest_layer_memory + int(18 * total_params / total_gpus)
        cpu_mem = (largest_layer_params if zero_init else total_params) * 4 * num_gpus_per_node * abf
    return int(cpu_mem), int(gpu_mem), largest_layer_memory
