"""The why lines of `gpuctl plan`: every figure with the formula or source behind it (pure)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal

from provision.estimate.hardware import GB
from provision.estimate.node import collective_timeout_s, node_requirements
from provision.estimate.node_terms import PROCESS_GB, NodeRequirements, Term

if TYPE_CHECKING:
    from provision.estimate.plan_result import PlanResult

# What gpuctl said and rented before issue 21 (the closing note compares).
OLD_MIN_RAM_GB, OLD_DISK_GB = 128, 200


def explain(r: PlanResult) -> list[str]:
    """The why lines of `gpuctl plan`: each figure with the formula behind it."""
    inp, m, mem, p, n = r.input, r.model, r.memory, r.params, r.input.total_gpus
    w = 4 if inp.precision == "fp32" else 2
    dtype = "fp32" if w == 4 else inp.precision
    off_staging = inp.offload_optimizer == "cpu" and inp.zero_stage in (1, 2)
    lines = [
        f"{m.name}: {p / 1e9:.2f}e9 parameters (Llama: {m.layers} layers, hidden {m.hidden}, "
        f"FFN {m.intermediate}, vocab {m.vocab}, {'tied' if m.tied_embeddings else 'untied'} embeddings)."
    ]
    if inp.zero_stage < 3:
        part = {0: "nothing", 1: "optimizer states", 2: "gradients and optimizer states"}[inp.zero_stage]
        lines.append(
            f"Floor: ZeRO-{inp.zero_stage} partitions {part} across the {n} ranks, but every rank keeps "
            f"a full {dtype} copy of the parameters: {p / 1e9:.2f}e9 x {w} bytes = {w * p / GB:.1f} GB "
            f"(~{w * p / GB:.0f} GB) per GPU whatever the GPU count or offload. "
            "Only ZeRO-3 partitions the parameters."
        )
    else:
        lines.append(
            f"ZeRO-3 partitions the parameters: {mem.weights_gb:.1f} GB per rank = "
            f"{'none (offload_param=cpu)' if inp.offload_param == 'cpu' else f'{w}P/{n}'} + 4 x the "
            f"largest layer ({m.largest_layer_params / 1e6:.0f}M params) gathered; it costs an "
            f"extra all-gather of the weights in forward and backward."
        )
    if inp.offload_optimizer == "cpu":
        lines.append(
            "offload_optimizer=cpu keeps the fp32 master, fp32 grads, Adam m and v and DeepSpeed's staging and "
            f"accumulation buffers in host RAM (see Host RAM below); the CPU runs Adam and the GPU keeps only "
            f"{dtype} weights and buffers."
        )
    else:
        lines.append(
            f"No offload: grads {mem.grads_gb:.1f} GB + fp32 master and Adam m/v {mem.optimizer_gb:.1f} GB "
            f"per rank on the GPU (DeepSpeed: 18 bytes/param, split over the ranks by ZeRO-2/3)."
        )
    lines.append(
        f"Activations, micro_batch {inp.micro_batch} x seq {inp.seq_len}: {mem.activations_ckpt_gb:.1f} GB "
        f"with gradient checkpointing, {mem.activations_full_gb:.1f} GB without (Korthikanti et al. "
        f"2022 count for Llama; {10 * inp.seq_len * inp.micro_batch * m.vocab / GB:.1f} GB of it is "
        f"the logits for vocab {m.vocab}). Using: "
        f"{'checkpointing' if inp.gradient_checkpointing else 'no checkpointing'}."
    )
    lines.append(
        f"Buffers {mem.buffers_gb:.1f} GB: reduce bucket {inp.reduce_bucket_size:.0e} elements x {w} bytes, "
        f"the dense gradient of the largest tensor ({m.largest_layer_params / 1e6:.0f}M)"
        f"{' and its offload staging copy' if off_staging else ''}"
        f"; plus {mem.fragmentation_gb:.1f} GB fragmentation ({inp.fragmentation:.0%}) and "
        f"{mem.cuda_context_gb:.1f} GB CUDA context."
    )
    verdict = (
        f"fits with {r.gpu_capacity_gb - mem.total_gb:.1f} GB to spare"
        if r.fits
        else f"does NOT fit (over by {mem.total_gb - r.gpu_capacity_gb:.1f} GB)"
    )
    lines.append(f"Per rank {mem.total_gb:.1f} GB of {r.gpu_capacity_gb:g} GB on {r.gpu.name}: {verdict}.")
    lines += host_lines(r)
    peak = r.gpu.peak_tflops_fp32 if w == 4 else r.gpu.peak_tflops_16bit
    lines.append(
        f"Compute only: {n} x {peak:g} TFLOP/s x {inp.mfu_low:.0%}-{inp.mfu_high:.0%} / "
        f"({r.flops_per_token / p:.0f} x params) FLOPs per token"
        f"{' (6 + 2 recompute)' if inp.gradient_checkpointing else ''} = "
        f"{r.tokens_per_s_low:,.0f}-{r.tokens_per_s_high:,.0f} tokens/s "
        f"(FLOP ceiling {r.flop_ceiling_tokens_per_s:,.0f}; peak: {r.gpu.source}); the step-time table below "
        "adds the gradient reduction, offload traffic, the optimizer step and the saves."
    )
    if inp.precision == "fp16" and r.gpu.bf16:
        lines.append(
            f"Precision: {r.gpu.name} runs bf16 at the same peak as fp16, without loss scaling or skipped steps "
            "(and most checkpoints, DeepSeek-7B's included, were trained in bf16): consider precision bf16."
        )
    return lines


def _terms(terms: tuple[Term, ...]) -> str:
    return " + ".join(f"{t.name} {t.gb:.1f}" for t in terms if t.gb >= 0.05)


def host_lines(r: PlanResult) -> list[str]:
    """Host RAM per node at load, steady and resume, disk, the collective timeout, and the old figures."""
    inp, node = r.input, r.node
    pin = {
        "exact": "pinned exact-size (torch >= 2.13; older torch: not pinned, the same bytes)",
        "off": "not pinned",
        "pow2": "pinned by torch's default allocator, each block rounded up to a power of two",
    }[node.pinning]
    lines = [
        f"Host RAM per node ({node.ranks} ranks, offload buffers {pin}): load {node.load_gb:.1f} GB, "
        f"steady {node.steady_gb:.1f} GB = {_terms(node.steady)}, resume {node.resume_gb:.1f} GB, save {node.save_gb:.1f} GB. "
        f"Rent at least {math.ceil(node.ram_gb)} GB (the worst phase + {node.reserve_gb:g} GB for the OS); "
        f"per rank steady {max(node.rank_steady_gb):.1f} GB (incl. {PROCESS_GB:g} GB process).",
    ]
    if node.pinning != "off" and inp.offload_optimizer == "cpu":
        pow2 = _with(r, "pow2")
        lines.append(
            f"Pinned: {node.pinned_gb:.1f} GB per node; torch's default power-of-two rounding would pin "
            f"{pow2.pinned_alloc_gb:.1f} GB and need {math.ceil(pow2.ram_gb)} GB of RAM."
        )
    if inp.resume_mmap:
        old = _with(r, resume_mmap=False)
        lines.append(
            f"Resume memory-maps the checkpoint files (torch.load mmap): {node.resume_gb:.1f} GB at that moment "
            f"instead of {old.resume_gb:.1f} GB with every rank reading its whole shard into RAM."
        )
    lines.append(
        f"Disk per node: {math.ceil(node.disk_gb)} GB = {_terms(node.disk)}; the trainer never lets saves that are "
        "not uploaded yet outgrow the free disk (it waits for uploads, then skips a save)."
    )
    seconds, waits = collective_timeout_s(inp, node)
    lines.append(
        f"Collective timeout {seconds / 60:.0f} min = max(30 min floor, 3 x the longest lone wait: "
        + ", ".join(f"{t.name} {t.gb / 60:.1f} min ({t.note})" for t in waits)
        + "). The end of the run holds no collective while the last upload runs."
    )
    lines.append(
        f"Before: plan said {r.ds_host_ram_gb:.1f} GB (DeepSpeed's estimate, x{inp.additional_buffer_factor} "
        f"buffer factor) and offers asked for {OLD_MIN_RAM_GB} GB RAM and {OLD_DISK_GB} GB disk; now "
        f"{math.ceil(node.ram_gb)} GB RAM and {math.ceil(node.disk_gb)} GB disk."
    )
    return lines


def _with(
    r: PlanResult, pinning: Literal["exact", "off", "pow2"] | None = None, resume_mmap: bool | None = None
) -> NodeRequirements:
    """The node of the same plan with pinning or resume_mmap changed (for the comparisons above): what
    plan's evaluation would give as its `.node`, without evaluating the rest of the plan."""
    from dataclasses import replace

    inp = r.input
    inp = replace(inp, pinning=pinning) if pinning is not None else inp
    inp = replace(inp, resume_mmap=resume_mmap) if resume_mmap is not None else inp
    return node_requirements(inp)
