"""Host RAM, disk and collective timeout of a node, term by term (pure computation).

`node_requirements(PlanInput)` is what `gpuctl plan` prints, what `up` and `offers` filter rentable machines
on, and what a doctor can check a machine against. GB are 10**9 bytes.

What DeepSpeed 0.19.8 keeps on the host per rank with ZeRO-1/2 and offload_optimizer=cpu
(deepspeed/runtime/zero/stage_1_and_2.py, line numbers of 0.19.8), w = bytes of the training dtype:
- fp32 master partition, 4 B x partition (l.559-565, pinned when pin_memory is on)
- 16-bit parameter staging, w B x partition (param_buffer_of_bit16_for_cpu_offload, l.566-575, pinned)
- fp32 gradient partition, 4 B x partition (initialize_optimizer_states, l.936-941, pinned)
- gradient staging, w B x the largest tensor (temp_grad_buffer_for_cpu_offload, l.653-658, pinned)
- with gradient_accumulation_steps > 1, one w-byte accumulation buffer per tensor of the partition, each the
  WHOLE tensor even when the partition holds part of it (async_accumulate_grad_in_cpu_via_gpu, l.1822-1826,
  pinned one tensor at a time)
- Adam m and v, 8 B x partition, pageable (deepspeed/ops/adam/cpu_adam.py l.161-164)
The partition: the parameters in model.parameters() order (interleaved by round_robin_gradients, l.901-922),
flattened, padded to 2 x world elements and split evenly (l.439-446); a rank holds the tensors that overlap
its slice (get_partition_info, l.2579-2611).

Pinning: torch's CachingHostAllocator rounds every pinned block up to a power of two
(ATen/core/CachingHostAllocator.h: torch 2.10 l.251 `roundSize = c10::llvm::PowerOf2Ceil(size)`, always; torch
2.13 l.302-309 only below `pinned_max_round_threshold_mb`, whose default is "never" (c10/core/AllocatorConfig.h
l.361)). The trainer pins exact-size (torch >= 2.13, with that threshold set) or not at all (older torch):
pinning "exact" and "off" cost the same bytes; "pow2" is what torch's default rounding would cost.

Transients: at load the model sits in host RAM in the training dtype until DeepSpeed moves it to the GPU;
ZeRO then flattens it on the CPU when the GPU has no room for a second copy (l.447-521: the parameters' CPU
copies plus the flat buffer); with pinning, each pinned buffer is a copy of a pageable one that lives until
DeepSpeed's __init__ returns. At resume every rank reads the 16-bit module states (w x P) and then its
optimizer shard (12 B x partition) into RAM, unless torch.load memory-maps the files (the trainer does).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from provision.estimate.hardware import GB, zero3_model_states_mem
from provision.estimate.node_terms import OS_RESERVE_GB, PROCESS_GB, NodeRequirements, Term, disk_terms, pow2

if TYPE_CHECKING:
    from provision.estimate.plan_input import PlanInput

# Collective timeout: the longest a rank can sit in a collective while another node-local rank works alone.
TIMEOUT_FLOOR_S = 1800  # never below 30 min (DeepSpeed's default, 10 min, is what issue 21 found too short)
TIMEOUT_SAFETY = 3.0
STORE_BYTES_PER_S = 50e6  # object storage -> node (assumed, conservative: 400 Mbit/s)
DISK_BYTES_PER_S = 200e6  # node disk writes (assumed, a network volume)
TOKENIZE_BYTES_PER_S = 1e6  # text tokenized per second by one rank (conservative; see README)


def partitions(numels: list[int], world: int, round_robin: bool) -> tuple[int, list[list[int]]]:
    """(partition size in elements, the tensors overlapping each rank's slice), as DeepSpeed splits them."""
    order = numels
    if round_robin:
        order = [n for j in range(world) for i, n in enumerate(numels) if i % world == j]
    align = 2 * world
    size = math.ceil(sum(order) / align) * align // world
    overlap: list[list[int]] = [[] for _ in range(world)]
    start = 0
    for n in order:
        for r in range(start // size, min(world, (start + n - 1) // size + 1)):
            overlap[r].append(n)
        start += n
    return size, overlap


@dataclass(frozen=True)
class _Rank:
    """One rank's host buffers in bytes with offload (see the module docstring)."""

    master: float
    staging: float
    grads: float
    grad_staging: float
    accum: tuple[float, ...]  # one block per tensor
    adam: float
    shard: float  # its optimizer shard on disk: fp32 master + m + v

    def pinned(self) -> list[float]:
        return [self.master, self.staging, self.grads, self.grad_staging, *self.accum]


def rank_buffers(inp: PlanInput) -> tuple[int, list[_Rank]]:
    """(partition size in elements, every rank's buffers)."""
    m, world = inp.dims, inp.total_gpus
    w = 4 if inp.precision == "fp32" else 2
    numels = m.param_numels()
    size, overlap = partitions(numels, world, inp.round_robin_gradients)
    out = []
    for r in range(world):
        accum = tuple(float(w * n) for n in overlap[r]) if inp.grad_accum > 1 else ()
        out.append(_Rank(4.0 * size, w * size, 4.0 * size, w * max(numels), accum, 8.0 * size, 12.0 * size))
    return size, out


def _alloc(blocks: list[float], pinning: str) -> float:
    return sum(pow2(b) if pinning == "pow2" else b for b in blocks)


def _term(name: str, ranks: list[_Rank], field: str, pinning: str | None, note: str = "") -> Term:
    """Sum a buffer over the node's ranks; pinning None: pageable (no rounding)."""
    blocks: list[float] = []
    for r in ranks:
        value = getattr(r, field)
        blocks += list(value) if isinstance(value, tuple) else [value]
    label = f"{name} (pinned)" if pinning else name
    return Term(label, _alloc(blocks, pinning or "exact") / GB, note)


def node_requirements(inp: PlanInput) -> NodeRequirements:
    """Host RAM (load, steady, resume, save) and disk for the heaviest node (node 0) of this configuration."""
    if inp.strategy == "fsdp":
        from provision.estimate.fsdp_node import fsdp_node_requirements

        return fsdp_node_requirements(inp)
    g, w, params = inp.gpus_per_node, (4 if inp.precision == "fp32" else 2), inp.dims.params
    size, ranks = rank_buffers(inp)
    node_ranks = ranks[:g]  # node 0: it also holds the module states file
    offload = inp.offload_optimizer == "cpu"
    pin = inp.pinning if offload and inp.pinning != "off" else None
    proc = Term("processes", PROCESS_GB * g, f"{g} x {PROCESS_GB:g} GB: CUDA, torch, Python per rank (assumed)")
    model_in_ram = Term("model in host RAM", g * w * params / GB, f"{g} x {w} B x {params / 1e9:.2f}e9 params")
    load_phases = [[proc, model_in_ram]]
    if _flattens_on_cpu(inp, w):
        flat = 2 * w * size * inp.total_gpus * g / GB
        load_phases.append([proc, Term("ZeRO flatten on the CPU", flat, "per rank: params' CPU copy + flat buffer")])
    module = Term("module states read at resume", 0.0 if inp.resume_mmap else model_in_ram.gb, "every rank")
    if inp.zero_stage == 3:  # not modelled buffer by buffer: DeepSpeed's own estimate (already per node)
        est = Term("ZeRO-3 states (DeepSpeed's estimate, x1.5)", _zero3_estimate(inp) / GB)
        return _result(inp, node_ranks, load_phases, (proc, est), (proc, est, module))
    shard = sum(r.shard for r in node_ranks) / GB
    if not offload:
        read = Term("optimizer shard read at resume", 0.0 if inp.resume_mmap else shard, "12 B x partition")
        return _result(inp, node_ranks, load_phases, (proc,), max((proc, module), (proc, read), key=_total))
    resident = [
        proc,
        _term("fp32 master", node_ranks, "master", pin, "4 B x partition"),
        _term("16-bit param staging" if w == 2 else "param staging", node_ranks, "staging", pin, f"{w} B x partition"),
        _term("fp32 gradients", node_ranks, "grads", pin, "4 B x partition"),
        _term("gradient staging", node_ranks, "grad_staging", pin, f"{w} B x the largest tensor"),
    ]
    copies = sum(r.staging + r.grads for r in node_ranks) / GB if pin else 0.0
    load_phases.append([*resident, Term("pageable copies being pinned", copies, "until DeepSpeed's init returns")])
    accum_note = f"grad_accum {inp.grad_accum}: {w} B x each whole tensor of the partition"
    steady = (
        *resident,
        _term("grad accumulation", node_ranks, "accum", pin, accum_note if inp.grad_accum > 1 else "grad_accum 1"),
        Term("Adam m + v", sum(r.adam for r in node_ranks) / GB, "8 B x partition, pageable"),
    )
    read = (
        Term("Adam m + v copied off the mapped shard", sum(r.adam for r in node_ranks) / GB, "mmap: rest is page cache")
        if inp.resume_mmap
        else Term("optimizer shard read into RAM", shard, "12 B x partition, every rank at once")
    )
    return _result(inp, node_ranks, load_phases, steady, max((*resident, module), (*resident, read), key=_total))


def _total(terms: Iterable[Term]) -> float:
    return sum(t.gb for t in terms)


def _flattens_on_cpu(inp: PlanInput, w: int) -> bool:
    """DeepSpeed flattens on the GPU only when it has room for a second copy of the weights (l.447-453)."""
    from provision.estimate.hardware import find_gpu

    capacity = inp.gpu_mem_gb if inp.gpu_mem_gb is not None else find_gpu(inp.gpu).mem_gb
    weights = w * inp.dims.params / inp.total_gpus if inp.zero_stage == 3 else w * inp.dims.params
    return capacity * GB - inp.cuda_context_gb * GB - weights < w * inp.dims.params


def _zero3_estimate(inp: PlanInput) -> float:
    cpu, _, _ = zero3_model_states_mem(
        inp.dims.params,
        inp.dims.largest_layer_params,
        inp.gpus_per_node,
        inp.nodes,
        inp.offload_optimizer == "cpu",
        inp.offload_param == "cpu",
        inp.zero_init,
        inp.additional_buffer_factor,
    )
    return cpu


def _result(
    inp: PlanInput,
    node_ranks: list[_Rank],
    load_phases: list[list[Term]],
    steady: tuple[Term, ...],
    resume: tuple[Term, ...],
) -> NodeRequirements:
    offload = inp.offload_optimizer == "cpu" and inp.zero_stage < 3
    pinning = inp.pinning if offload else "off"
    pinned = [b for r in node_ranks for b in r.pinned()] if offload and pinning != "off" else []
    rank_steady = tuple(
        PROCESS_GB + ((_alloc(r.pinned(), pinning) + r.adam) / GB if offload else 0.0) for r in node_ranks
    )
    w = 4 if inp.precision == "fp32" else 2
    checkpoint = (w * inp.dims.params + sum(r.shard for r in node_ranks)) / GB
    save = (*steady, save_term(inp)) if inp.zero_stage < 3 else steady
    return NodeRequirements(
        ranks=len(node_ranks),
        pinning=pinning,
        load=tuple(max(load_phases, key=_total)),
        steady=steady,
        resume=resume,
        save=save,
        reserve_gb=OS_RESERVE_GB,
        disk=disk_terms(inp, checkpoint),
        checkpoint_gb=checkpoint,
        pinned_gb=sum(pinned) / GB,
        pinned_alloc_gb=_alloc(pinned, pinning) / GB,
        rank_steady_gb=rank_steady,
    )


def save_term(inp: PlanInput) -> Term:
    """Rank 0's save of the module states: ZeRO-1/2's module parameters are views of one flat GPU buffer
    (16-bit, or fp32) per parameter group (stage_1_and_2.py l.447-521), so the state dict's tensors share that storage
    and torch.save copies the whole storage to the host before writing it (torch/serialization.py _save,
    l.1290-1310 in torch 2.13: `storage.cpu()`, or a pinned buffer, one storage at a time). The trainer
    passes one parameter group: one flat buffer, padded to the partition layout."""
    w = 4 if inp.precision == "fp32" else 2
    size, _ = partitions(inp.dims.param_numels(), inp.total_gpus, inp.round_robin_gradients)
    return Term(
        "module states copied to host at save", w * size * inp.total_gpus / GB, "rank 0: the flat weight buffer"
    )


def collective_timeout_s(inp: PlanInput, req: NodeRequirements | None = None) -> tuple[int, tuple[Term, ...]]:
    """Seconds for the process group's timeout, and the waits it covers (Term.gb holds seconds here):
    other ranks sit in a collective while local rank 0 downloads a checkpoint to resume, tokenizes the
    data, or writes the module states on top of its own shard."""
    req = req or node_requirements(inp)
    w = 4 if inp.precision == "fp32" else 2
    waits = [
        Term("resume download", req.checkpoint_gb * GB / STORE_BYTES_PER_S, f"at {STORE_BYTES_PER_S / 1e6:g} MB/s"),
        Term("module states save", w * inp.dims.params / DISK_BYTES_PER_S, f"at {DISK_BYTES_PER_S / 1e6:g} MB/s"),
    ]
    if inp.data_bytes:
        waits.append(Term("tokenize", inp.data_bytes / TOKENIZE_BYTES_PER_S, f"at {TOKENIZE_BYTES_PER_S / 1e6:g} MB/s"))
    longest = max(t.gb for t in waits)
    return max(TIMEOUT_FLOOR_S, math.ceil(TIMEOUT_SAFETY * longest / 60) * 60), tuple(waits)
