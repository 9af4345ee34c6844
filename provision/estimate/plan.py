"""`gpuctl plan`: will this model train on these GPUs, and how fast? (laptop side, pure Python).

GB below are 10**9 bytes (so 6.91e9 params x 2 bytes = 13.8 GB). `gpu_mem_gb` is compared in the same
unit; a "24 GB" RTX 4090 really has 24 GiB = 25.8 GB, which leaves ~1.8 GB of slack for the driver.

Per-rank GPU memory = model states + buffers + activations + fragmentation + CUDA context.

* Model states mirror DeepSpeed 0.19's `estimate_zero2_model_states_mem_needs` (stage_1_and_2.py) and
  `estimate_zero3_model_states_mem_needs` (stage3.py); for 16-bit ZeRO-2/3 the totals are equal to theirs
  (tests/test_plan.py compares). Bytes/param: 2 fp16 weights; 18/N without offload = 2 fp16 grads +
  4 fp32 grads + 4 fp32 master + 8 Adam m/v. ZeRO-2 keeps the full fp16 weights on every rank; only
  ZeRO-3 partitions them (and holds 4 x largest layer gathered). Stages 0/1 and fp32 use the same accounting.
* Buffers (DeepSpeed stage_1_and_2.py): the gradient reduce bucket (reduce_bucket_size elements, x2 with
  overlap_comm), with offload the GPU staging buffer `temp_grad_buffer_for_gpu_offload` (largest tensor),
  plus the transient dense gradient of that largest tensor (the embedding / lm_head).
* Activations, per micro-batch b x seq s, hidden h, FFN I, L layers, 16-bit: Korthikanti et al. 2022,
  "Reducing Activation Recomputation in Large Transformer Models" (arXiv:2205.05198) count 34sbh + 5as^2b
  bytes per GPT layer. Re-done for Llama (no dropout, RMSNorm, SwiGLU, SDPA/flash attention so no s^2
  term): attention saves norm input 2sbh + QKV input 2sbh + Q 2sbh + K,V 4sbh*kv/heads + output 2sbh;
  the MLP saves norm input 2sbh + gate/up input 2sbh + gate, silu(gate), up, product 8sbI:
      per layer = sbh(12 + 4 kv/heads) + 8sbI      (= 16sbh + 8sbI for multi-head attention)
  eager attention adds Korthikanti's 5as^2b. Head: 4sbh + 10sbV (fp16 logits 2 + fp32 log-softmax 4 +
  fp32 grad 4, as HF upcasts logits for the loss). Full recomputation (Korthikanti sec. 4) keeps 2sbh per
  layer and recomputes one layer at a time: L*2sbh + one layer + head.
* Throughput: N x peak x utilisation / FLOPs per token, 6 x params per token (Kaplan et al. 2020), x 8/6
  with checkpointing (the forward runs twice). Utilisation 25-45% is the assumption, not a measurement.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from dataclasses import replace
from typing import Any, Literal

from provision.estimate.explain import explain
from provision.estimate.hardware import GB, ModelDims, find_gpu, zero2_model_states_mem, zero3_model_states_mem
from provision.estimate.node import collective_timeout_s, node_requirements
from provision.estimate.node_terms import node_to_json
from provision.estimate.plan_input import PlanInput
from provision.estimate.plan_result import GpuMemory, PlanResult


def _activation_bytes(inp: PlanInput, m: ModelDims) -> tuple[float, float]:
    """(with checkpointing, without) for one micro-batch; see the module docstring for the formula."""
    s, b, h = inp.seq_len, inp.micro_batch, m.hidden
    kv_ratio = (m.kv_heads or m.heads) / m.heads
    layer = s * b * h * (12 + 4 * kv_ratio) + 8 * s * b * m.intermediate
    if inp.attention == "eager":
        layer += 5 * m.heads * s * s * b
    head = 4 * s * b * h + 10 * s * b * m.vocab
    scale = 2.0 if inp.precision == "fp32" else 1.0
    return scale * (m.layers * 2 * s * b * h + layer + head), scale * (m.layers * layer + head)


def _evaluate(inp: PlanInput) -> PlanResult:
    m, n, st = inp.dims, inp.total_gpus, inp.zero_stage
    p, ll = m.params, m.largest_layer_params
    w = 4 if inp.precision == "fp32" else 2
    off, off_p = inp.offload_optimizer == "cpu", inp.offload_param == "cpu"
    grad_b = w + (0 if w == 4 else 4)  # 16-bit grads + their fp32 copy; fp32 grads only
    opt_b = 8 if (st == 0 and w == 4) else 12  # Adam m + v (+ fp32 master, except plain fp32 DDP)
    weights = (0 if off_p else w * p / n) + 4 * ll if st == 3 else w * p
    grads: float
    if st == 0:
        grads = grad_b * p
    elif st == 1:  # full 16-bit grads on every rank, fp32 grads partitioned (or offloaded)
        grads = w * p + (0 if off else (grad_b - w) * p / n)
    else:  # DeepSpeed counts ZeRO-3 grads as 4 bytes/param/N (its 18 = 2 + 4 + 12)
        grads = 0.0 if off else (grad_b if st == 2 else 4) * p / n
    opt = 0.0 if off else opt_b * p / (1 if st == 0 else n)
    states = int(weights + grads + opt)
    if st == 3:
        ds_cpu, ds_gpu, _ = zero3_model_states_mem(
            p, ll, inp.gpus_per_node, inp.nodes, off, off_p, inp.zero_init, inp.additional_buffer_factor
        )
    else:
        ds_cpu, ds_gpu = zero2_model_states_mem(p, inp.gpus_per_node, inp.nodes, off, inp.additional_buffer_factor)
    if w == 2 and st >= 2:
        states = ds_gpu  # the same sum, DeepSpeed's rounding
    overlap = inp.overlap_comm if inp.overlap_comm is not None else st == 3
    buffers = inp.reduce_bucket_size * w * (2 if overlap else 1) + w * ll  # bucket + transient dense grad
    if off and st in (1, 2):
        buffers += w * ll  # temp_grad_buffer_for_gpu_offload
    act_ckpt, act_full = _activation_bytes(inp, m)
    act = act_ckpt if inp.gradient_checkpointing else act_full
    frag = inp.fragmentation * (states + buffers + act)
    mem = GpuMemory(
        weights / GB,
        grads / GB,
        opt / GB,
        buffers / GB,
        act / GB,
        act_ckpt / GB,
        act_full / GB,
        frag / GB,
        inp.cuda_context_gb,
        states,
    )
    spec = find_gpu(inp.gpu)
    node = node_requirements(inp)
    capacity = inp.gpu_mem_gb if inp.gpu_mem_gb is not None else spec.mem_gb
    peak = (spec.peak_tflops_fp32 if w == 4 else spec.peak_tflops_16bit) * 1e12
    fpt = 6 * p * (8 / 6 if inp.gradient_checkpointing else 1)
    return PlanResult(
        input=inp,
        model=m,
        params=p,
        gpu=spec,
        gpu_capacity_gb=capacity,
        memory=mem,
        node=node,
        collective_timeout_s=collective_timeout_s(inp, node)[0],
        ds_host_ram_gb=ds_cpu / GB,
        host_adam_states_gb=((16 + 2 * off_p) * p / inp.nodes if off else 0) / GB,
        fits=mem.total_gb <= capacity,
        flops_per_token=fpt,
        tokens_per_s_low=n * peak * inp.mfu_low / fpt,
        tokens_per_s_high=n * peak * inp.mfu_high / fpt,
        flop_ceiling_tokens_per_s=n * peak / (6 * p),
    )


_OFFLOAD_CHOICES: tuple[Literal["none", "cpu"], ...] = ("none", "cpu")


def _candidates(inp: PlanInput) -> Iterator[PlanInput]:
    micros = sorted({inp.micro_batch} | {inp.micro_batch >> k for k in range(8) if inp.micro_batch >> k >= 1})
    seqs = sorted({inp.seq_len} | {inp.seq_len >> k for k in range(6) if inp.seq_len >> k >= 128})
    for st, off, off_p, ckpt, mb, sl in itertools.product(
        (0, 1, 2, 3), _OFFLOAD_CHOICES, _OFFLOAD_CHOICES, (False, True), micros, seqs
    ):
        if (off == "cpu" and st == 0) or (off_p == "cpu" and (st != 3 or off != "cpu")):
            continue
        yield replace(
            inp,
            zero_stage=st,
            offload_optimizer=off,
            offload_param=off_p,
            gradient_checkpointing=ckpt,
            micro_batch=mb,
            seq_len=sl,
        )


def _changes(a: PlanInput, b: PlanInput) -> tuple[float, list[str]]:
    """Cost of moving from a to b (training math kept > speed kept > data changed) and what changes."""
    cost, out = 0.0, []
    for name, unit in (
        ("offload_optimizer", 1),
        ("zero_stage", 1),
        ("offload_param", 2),
        ("gradient_checkpointing", 1),
        ("micro_batch", 1),
        ("seq_len", 3),
    ):
        old, new = getattr(a, name), getattr(b, name)
        if old == new:
            continue
        if name in ("micro_batch", "seq_len"):  # per halving
            steps = max(1, (old // new).bit_length() - 1) if new < old else 1
        else:
            steps = abs(old - new) + (new == 3) if name == "zero_stage" else 1
        cost += unit * steps
        out.append(
            f"{name}={str(new).lower() if isinstance(new, bool) else new}"
            + (" (raise gradient_accumulation_steps to keep the batch)" if name == "micro_batch" else "")
        )
    return cost, out


def plan(inp: PlanInput) -> PlanResult:
    """Plan one configuration; when it does not fit, also find the cheapest change that does."""
    result = _evaluate(inp)
    why = explain(result)
    closest, changes = None, []
    if not result.fits:
        best = None
        for cand in _candidates(inp):
            r = _evaluate(cand)
            if r.fits:
                cost, ch = _changes(inp, cand)
                key = (cost, -r.tokens_per_s_high, r.memory.total_gb)
                if best is None or key < best[0]:
                    best = (key, r, ch)
        if best is None:
            why.append(
                "Nothing fits, even ZeRO-3 with parameter offload, micro_batch 1 and short sequences: "
                "use GPUs with more memory or more GPUs."
            )
        else:
            closest, changes = replace(best[1], why=explain(best[1])), best[2]
            why.append(
                f"Closest config that fits: {', '.join(changes)} -> {closest.memory.total_gb:.1f} GB "
                f"per rank, {closest.tokens_per_s_low:,.0f}-{closest.tokens_per_s_high:,.0f} tokens/s."
            )
    return replace(result, why=why, closest=closest, closest_changes=changes)


def plan_to_json(result: PlanResult) -> dict[str, Any]:
    """JSON-ready dict (for `gpuctl plan --json`)."""
    mem = result.memory
    inp = dataclasses.asdict(result.input)
    inp["model"] = result.model.name if isinstance(result.input.model, str) else dataclasses.asdict(result.model)
    return {
        "model": result.model.name,
        "params": result.params,
        "input": inp,
        "gpu": result.gpu.name,
        "gpu_mem_gb": result.gpu_capacity_gb,
        "gpu_gb_per_rank": round(mem.total_gb, 3),
        "gpu_breakdown_gb": {
            k.removesuffix("_gb"): round(v, 3) for k, v in dataclasses.asdict(mem).items() if k.endswith("_gb")
        }
        | {"model_states": round(mem.model_states_bytes / GB, 3)},
        "model_states_gpu_bytes": mem.model_states_bytes,
        "host_ram_gb": round(result.host_ram_gb, 3),
        "node": node_to_json(result.node),
        "collective_timeout_s": result.collective_timeout_s,
        "ds_host_ram_gb": round(result.ds_host_ram_gb, 3),
        "host_adam_states_gb": round(result.host_adam_states_gb, 3),
        "fits": result.fits,
        "tokens_per_s": {"low": round(result.tokens_per_s_low, 1), "high": round(result.tokens_per_s_high, 1)},
        "flop_ceiling_tokens_per_s": round(result.flop_ceiling_tokens_per_s, 1),
        "peak_tflops": result.gpu.peak_tflops_fp32
        if result.input.precision == "fp32"
        else result.gpu.peak_tflops_16bit,
        "peak_source": result.gpu.source,
        "why": list(result.why),
        "closest": plan_to_json(result.closest) if result.closest else None,
        "closest_changes": list(result.closest_changes),
    }
