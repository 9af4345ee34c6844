"""Host RAM and disk of a node under train.strategy fsdp, term by term (pure computation).

What trainer/fsdp_engine.py keeps on the host per rank (torch 2.13's FSDP2, torch/distributed/fsdp/_fully_shard):
- load: trainer.model builds the whole model in fp32 on the CPU in every rank (4 B x P each) before
  fully_shard moves or offloads its shards.
- offload_optimizer cpu (CPUOffloadPolicy): each parameter's padded fp32 shard on the host, pinned when the
  policy pins (_fsdp_param.py l.312-315: `.cpu()` then `.pin_memory()`, one block per parameter); the
  reduce-scattered fp32 gradient shards copied to the host (_fsdp_collectives.py l.711-743: `.to("cpu",
  non_blocking=pin_memory)`, which allocates pinned host memory when non-blocking); AdamW's m and v
  (zeros_like of the CPU shards: pageable, 8 B x shard).
- pinning: the trainer decides it as for DeepSpeed (trainer.pinning.pin_offload): exact-size on torch >= 2.13,
  not at all on older torch; "pow2" is what torch's default rounding would cost, block by block.
- save and resume: torch.distributed.checkpoint writes and reads the shards in place (host-resident with
  offload): no phase above steady is modelled.
Without offload the shards live on the GPUs: the host keeps the processes (and the fp32 model at load).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from provision.estimate.hardware import GB, ModelDims
from provision.estimate.node_terms import OS_RESERVE_GB, PROCESS_GB, NodeRequirements, Term, disk_terms, pow2

if TYPE_CHECKING:
    from provision.estimate.plan_input import PlanInput


def shard_numels(m: ModelDims, world: int) -> list[int]:
    """Elements of each of one rank's parameter shards: every parameter's dim 0 padded to a multiple of
    `world` (FSDP2 pins and offloads each parameter's shard as its own tensor)."""
    kv_dim = (m.kv_heads or m.heads) * (m.hidden // m.heads)
    h, i = m.hidden, m.intermediate
    rows_cols = [(h, h), (kv_dim, h), (kv_dim, h), (h, h), (i, h), (i, h), (h, i), (h, 1), (h, 1)] * m.layers
    rows_cols += [(m.vocab, h), (h, 1)] + ([] if m.tied_embeddings else [(m.vocab, h)])
    return [math.ceil(rows / world) * cols for rows, cols in rows_cols]


def fsdp_node_requirements(inp: PlanInput) -> NodeRequirements:
    g, params = inp.gpus_per_node, inp.dims.params
    shards = [4.0 * n for n in shard_numels(inp.dims, inp.total_gpus)]  # one rank's fp32 blocks, bytes
    offload = inp.offload_optimizer == "cpu"
    pinning = inp.pinning if offload else "off"
    pinned = pinning != "off"
    proc = Term("processes", PROCESS_GB * g, f"{g} x {PROCESS_GB:g} GB: CUDA, torch, Python per rank (assumed)")
    load = (proc, Term("fp32 model in host RAM", g * 4 * params / GB, f"every rank builds it: {g} x 4 B x P"))
    steady: tuple[Term, ...] = (proc,)
    rank_blocks = 2 * shards if pinned else []
    if offload:
        block_gb = sum(pow2(b) if pinning == "pow2" else b for b in shards) * g / GB
        label = " (pinned)" if pinned else ""
        steady = (
            proc,
            Term(f"fp32 weight shards{label}", block_gb, "CPUOffloadPolicy: 4 B x shard, a block per parameter"),
            Term(f"fp32 gradient shards{label}", block_gb, "reduce-scattered, copied to the host"),
            Term("AdamW m + v", 2 * sum(shards) * g / GB, "8 B x shard, pageable"),
        )
    rank_steady = PROCESS_GB + (sum(t.gb for t in steady[1:]) / g if offload else 0.0)
    checkpoint = 3 * sum(shards) * g / GB  # DCP: fp32 weights + m + v of this node's ranks
    return NodeRequirements(
        ranks=g,
        pinning=pinning,
        load=load,
        steady=steady,
        resume=steady,
        save=steady,
        reserve_gb=OS_RESERVE_GB,
        disk=disk_terms(inp, checkpoint),
        checkpoint_gb=checkpoint,
        pinned_gb=sum(rank_blocks) * g / GB,
        pinned_alloc_gb=sum(pow2(b) if pinning == "pow2" else b for b in rank_blocks) * g / GB,
        rank_steady_gb=(rank_steady,) * g,
    )
