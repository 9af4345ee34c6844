"""What one checkpoint save costs: bytes on each node's disk and in the store, upload time, and whether
saves come faster than uploads (pure computation; `gpuctl plan` prints it).

Sizes follow the files DeepSpeed 0.19 and torch.distributed.checkpoint write (trainer/checkpoint.py):
* ZeRO-1/2: `mp_rank_00_model_states.pt` on node 0 holds the module's weights (2 B/param 16-bit, 4 B fp32);
  every rank's `zero_pp_rank_R_..._optim_states.pt` holds its partition of the fp32 master weights and
  Adam's m and v (12 B/param, partitions padded like DeepSpeed's, provision.estimate.node.rank_buffers).
* ZeRO-3: the weights are partitioned too; each rank's files hold its 12 B/param optimizer partition (its
  16-bit parameter partition rides in the same state, so nothing full-size is written).
* ZeRO-0: rank 0 writes everything: the weights, fp32 master (16-bit runs only), m and v.
* FSDP2 (trainer/fsdp_engine.py, DCP): every rank writes its fp32 parameter shard and Adam's m and v (12 B per
  element of its shard, provision.estimate.fsdp.sharded_numel).
Every node uploads its own files in parallel (its own link), so a save's upload takes the heaviest node's
bytes over the per-node bandwidth. The trainer's uploader keeps one upload running and one waiting; a save
that arrives while one waits supersedes it (trainer/objstore/uploader.py), so when saves come faster than
uploads the store gets only about one save per upload time: `piles_up` says so, with the checkpoint_every
that keeps up.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from provision.estimate.hardware import GB
from provision.estimate.node import STORE_BYTES_PER_S

if TYPE_CHECKING:
    from provision.core.checks import CheckRow
    from provision.estimate.plan_result import PlanResult

# torch.distributed.checkpoint's own bytes beside the tensors (torch 2.13, measured on tiny saves of 2 and 3
# ranks): per rank and state tensor (weight, m, v) ~1.24 KB of pickled entry, and ~0.23 MB of .metadata.
DCP_ENTRY_BYTES = 1241
DCP_FIXED_BYTES = 234_000
DEFAULT_UPLOAD_MBPS = STORE_BYTES_PER_S / 1e6  # MB/s per node when neither --upload-mbps nor a doctor run says
_PUT = re.compile(r"put ([\d,.]+) MB/s")


@dataclass(frozen=True)
class CheckpointCost:
    strategy: str
    node_bytes: int  # one save on the heaviest node's disk (node 0)
    store_bytes: int  # one save in the store (every node's files)
    upload_mbps: float  # per node, MB/s (10**6 bytes)
    upload_source: str  # where that figure comes from
    upload_s: float  # one save's upload (the heaviest node)
    step_s: tuple[float, float]  # fastest and slowest optimizer step (plan's tokens/s range)
    checkpoint_every: int  # steps; 0: only at the end
    keep_local: int
    disk_bytes: int  # the node's disk for keep_local saves + the one being written
    lag_disk_bytes: int  # ... + the one still uploading when uploads lag (no save then waits for disk)

    @property
    def save_every_s(self) -> float | None:
        """Time between saves at the fastest step; None when only the final step saves."""
        return self.checkpoint_every * self.step_s[0] if self.checkpoint_every else None

    @property
    def piles_up(self) -> bool:
        every = self.save_every_s
        return every is not None and every < self.upload_s

    @property
    def keeps_up_every(self) -> int:
        """The smallest checkpoint_every whose saves (at the fastest step) do not outrun the uploads."""
        return max(1, math.ceil(self.upload_s / self.step_s[0])) if self.step_s[0] > 0 else 1

    def warning(self) -> str | None:
        every = self.save_every_s
        if every is None or not self.piles_up:
            return None
        return (
            f"uploads pile up: a save every ~{seconds(every)} (checkpoint_every {self.checkpoint_every} x "
            f"{seconds(self.step_s[0])}/step) but one upload takes ~{seconds(self.upload_s)} at "
            f"{self.upload_mbps:g} MB/s; the uploader skips (supersedes) the saves in between, so the store "
            f"gets about one save every {seconds(self.upload_s)}. Set train.checkpoint_every >= "
            f"{self.keeps_up_every} to upload every save"
        )


def seconds(value: float) -> str:
    return f"{value:,.0f} s" if value >= 10 else f"{value:.2g} s"


def save_bytes(result: PlanResult, strategy: str = "deepspeed") -> tuple[int, int]:
    """(node 0's bytes, the store's bytes) of one save for this plan's configuration."""
    inp = result.input
    params, world, local = inp.dims.params, inp.total_gpus, inp.gpus_per_node
    w = 4 if inp.precision == "fp32" else 2
    if strategy == "fsdp":
        from provision.estimate.fsdp import sharded_numel

        m = inp.dims
        tensors = 9 * m.layers + 2 + (0 if m.tied_embeddings else 1)
        rank = 12 * sharded_numel(m, world) + 3 * tensors * DCP_ENTRY_BYTES
        return DCP_FIXED_BYTES + local * rank, DCP_FIXED_BYTES + world * rank
    if inp.zero_stage == 0:
        states = w * params + (12 if w == 2 else 8) * params
        return states, states
    if inp.zero_stage == 3:
        shard = 12 * math.ceil(params / world)
        return local * shard, world * shard
    from provision.estimate.node import rank_buffers

    _, ranks = rank_buffers(inp)
    shards = [int(r.shard) for r in ranks]
    return w * params + sum(shards[:local]), w * params + sum(shards)


def measured_put_mbps(rows: list[CheckRow]) -> float | None:
    """The slowest node's storage put throughput from a doctor run's rows, MB/s; None when not measured."""
    found = [_PUT.search(r.value) for r in rows if r.check.startswith("storage throughput")]
    rates = [float(m.group(1).replace(",", "")) for m in found if m]
    return min(rates) if rates else None


def checkpoint_cost(
    result: PlanResult,
    checkpoint_every: int,
    upload_mbps: float | None = None,
    upload_source: str = "",
    strategy: str = "deepspeed",
    step_s: tuple[float, float] | None = None,
) -> CheckpointCost:
    """The cost of one save for this plan; upload_mbps None: DEFAULT_UPLOAD_MBPS (assumed). step_s: the step
    time's range (provision/estimate/step_time.py); None: plan's compute-only MFU band."""
    if upload_mbps is None:
        upload_mbps, upload_source = DEFAULT_UPLOAD_MBPS, "assumed (pass --upload-mbps, or run `gpuctl doctor`)"
    node, store = save_bytes(result, strategy)
    inp = result.input
    tokens = inp.micro_batch * inp.grad_accum * inp.total_gpus * inp.seq_len
    fast, slow = step_s or (tokens / result.tokens_per_s_high, tokens / result.tokens_per_s_low)
    return CheckpointCost(
        strategy=strategy,
        node_bytes=node,
        store_bytes=store,
        upload_mbps=upload_mbps,
        upload_source=upload_source,
        upload_s=node / (upload_mbps * 1e6),
        step_s=(fast, slow),
        checkpoint_every=checkpoint_every,
        keep_local=inp.keep_local,
        disk_bytes=(inp.keep_local + 1) * node,
        lag_disk_bytes=(inp.keep_local + 2) * node,
    )


def cost_to_json(cost: CheckpointCost) -> dict[str, Any]:
    return {
        "strategy": cost.strategy,
        "node_bytes": cost.node_bytes,
        "store_bytes": cost.store_bytes,
        "node_gb": round(cost.node_bytes / GB, 3),
        "store_gb": round(cost.store_bytes / GB, 3),
        "upload_mbps": cost.upload_mbps,
        "upload_source": cost.upload_source,
        "upload_s": round(cost.upload_s, 1),
        "step_s": [round(s, 3) for s in cost.step_s],
        "checkpoint_every": cost.checkpoint_every,
        "save_every_s": None if cost.save_every_s is None else round(cost.save_every_s, 1),
        "piles_up": cost.piles_up,
        "keeps_up_checkpoint_every": cost.keeps_up_every,
        "keep_local": cost.keep_local,
        "disk_gb": round(cost.disk_bytes / GB, 3),
        "lag_disk_gb": round(cost.lag_disk_bytes / GB, 3),
        "warning": cost.warning(),
    }
