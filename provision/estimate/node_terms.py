"""A node's requirements as figures: named terms of memory or disk (Term), the totals per phase a machine must
hold (NodeRequirements), and their JSON. The vocabulary of estimate/node.py (DeepSpeed) and estimate/fsdp_node.py
(FSDP), which both build a NodeRequirements from a PlanInput. GB are 10**9 bytes (pure computation)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from provision.estimate.hardware import GB

if TYPE_CHECKING:
    from provision.estimate.plan_input import PlanInput

PROCESS_GB = 3.0  # per GPU rank: CUDA context, cuBLAS/cuDNN/NCCL host buffers, torch, Python (assumed)
OS_RESERVE_GB = 4.0  # the OS, sshd, the launcher, page cache for the token file
IMAGE_DISK_GB = 20.0  # the trainer image (CUDA runtime, torch, DeepSpeed) where it shares the node's disk


@dataclass(frozen=True)
class Term:
    """One named amount of memory or disk, in GB, with where it comes from."""

    name: str
    gb: float
    note: str = ""


@dataclass(frozen=True)
class NodeRequirements:
    """Per node (the heaviest node of the run), GB. Terms are summed over the node's ranks."""

    ranks: int  # ranks on the node
    pinning: str  # exact | off | pow2
    load: tuple[Term, ...]  # resident at the worst moment of loading (model, flatten, optimizer init)
    steady: tuple[Term, ...]  # while training
    resume: tuple[Term, ...]  # the worst moment of loading a checkpoint (before the first step)
    save: tuple[Term, ...]  # steady + what a save brings to the host at once (node 0: rank 0's module states)
    reserve_gb: float
    disk: tuple[Term, ...]
    checkpoint_gb: float  # one save on this node
    pinned_gb: float  # bytes the node asks to pin
    pinned_alloc_gb: float  # bytes the allocator pins for them (power-of-two rounding with "pow2")
    rank_steady_gb: tuple[float, ...]  # per rank of the node, steady, process included

    @property
    def load_gb(self) -> float:
        return sum(t.gb for t in self.load)

    @property
    def steady_gb(self) -> float:
        return sum(t.gb for t in self.steady)

    @property
    def resume_gb(self) -> float:
        return sum(t.gb for t in self.resume)

    @property
    def save_gb(self) -> float:
        return sum(t.gb for t in self.save)

    @property
    def ram_gb(self) -> float:
        """What a machine needs: the worst phase (load, steady, save, resume) plus the OS reserve."""
        return max(self.load_gb, self.steady_gb, self.save_gb, self.resume_gb) + self.reserve_gb

    @property
    def disk_gb(self) -> float:
        return sum(t.gb for t in self.disk)


def pow2(nbytes: float) -> float:
    return float(2 ** math.ceil(math.log2(nbytes))) if nbytes > 0 else 0.0


def disk_terms(inp: PlanInput, checkpoint_gb: float) -> tuple[Term, ...]:
    """The node's disk: model download, keep_local + 1 saves (one being written), image, data."""
    downloaded = isinstance(inp.model, str) and inp.model != "tiny"
    terms = [
        Term("model download (HF cache)", 2 * inp.dims.params / GB if downloaded else 0.0, "16-bit safetensors"),
        Term(
            f"checkpoints ({inp.keep_local} kept + 1 being written)",
            (inp.keep_local + 1) * checkpoint_gb,
            f"{checkpoint_gb:.1f} GB per save on this node",
        ),
        Term("trainer image", IMAGE_DISK_GB, "where the image shares the node's disk (assumed)"),
    ]
    if inp.data_bytes:
        terms.append(Term("dataset + token cache", 2 * inp.data_bytes / GB, "the file and its tokens"))
    return tuple(terms)


def node_to_json(req: NodeRequirements) -> dict[str, object]:
    """JSON-ready figures (plan --json, doctor): totals and every term, GB."""

    def terms(ts: tuple[Term, ...]) -> dict[str, float]:
        return {t.name: round(t.gb, 3) for t in ts}

    return {
        "ranks": req.ranks,
        "pinning": req.pinning,
        "ram_gb": round(req.ram_gb, 3),
        "load_gb": round(req.load_gb, 3),
        "steady_gb": round(req.steady_gb, 3),
        "resume_gb": round(req.resume_gb, 3),
        "save_gb": round(req.save_gb, 3),
        "reserve_gb": req.reserve_gb,
        "load": terms(req.load),
        "steady": terms(req.steady),
        "resume": terms(req.resume),
        "save": terms(req.save),
        "pinned_gb": round(req.pinned_gb, 3),
        "pinned_alloc_gb": round(req.pinned_alloc_gb, 3),
        "rank_steady_gb": [round(x, 3) for x in req.rank_steady_gb],
        "disk_gb": round(req.disk_gb, 3),
        "disk": terms(req.disk),
        "checkpoint_gb": round(req.checkpoint_gb, 3),
    }
