"""The rates the step-time model (provision/estimate/step_time.py) divides by: the node's own, measured by
`gpuctl doctor` (trainer/doctor_rates.py), else the tables below, each with its source and a low-high range.

A measured rate is read from the doctor's JSON through a type check (the node's answer is untrusted): an
odd or missing figure is simply not measured, and the table's rate stands. Measured rates carry a
+-MEASURED_SPREAD band (the repeat-to-repeat spread of a loaded node; benchmarks/bench_plan_model.py);
table rates carry the range of their assumption.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from provision.estimate.hardware import GpuSpec, ModelDims

MEASURED_SPREAD = 0.15  # a measured rate: time x 0.87..1.18 (1.35x, inside the 1.6x the model promises)


@dataclass(frozen=True)
class Rate:
    """A rate (per second) with its low-high range and where it came from."""

    low: float  # the slow end (longest time)
    high: float
    unit: str  # FLOP/s, B/s, params/s, s (a fixed cost: seconds, not a rate)
    source: str

    @property
    def mid(self) -> float:
        return math.sqrt(self.low * self.high)

    @property
    def measured(self) -> bool:
        return self.source.startswith("doctor")


def measured(value: float, unit: str, source: str) -> Rate:
    if unit == "s":  # a fixed cost: the "rate" is the seconds themselves, low = the long end
        return Rate(value * (1 + MEASURED_SPREAD), value / (1 + MEASURED_SPREAD), unit, source)
    return Rate(value / (1 + MEASURED_SPREAD), value * (1 + MEASURED_SPREAD), unit, source)


# --- tables -----------------------------------------------------------------------------------
# All-reduce bus bandwidth within one node, GB/s (nccl-tests' busbw). RTX 4090s have no P2P: NCCL goes
# through host memory (SHM), measured at 4-8 GB/s on PCIe 4.0 hosts in nccl-tests reports; PCIe cards
# with P2P reach 10-20; SXM parts ride NVLink.
BUSBW_GBS = {
    "RTX 4090": (4.0, 8.0),
    "A10G": (8.0, 16.0),
    "L4": (8.0, 16.0),
    "H100 PCIe": (15.0, 25.0),
    "A100": (150.0, 230.0),
    "H100": (300.0, 370.0),
    "H200": (300.0, 370.0),
}
# Host<->device copy, GB/s. PCIe 4.0 x16, an RTX 4090 (NVlabs/cuda-oxide PR #976, 1-64 MiB): pinned h2d
# 22.5-23.9, d2h 25.4-26.6; pageable h2d 12.9-18.4, d2h 9.2-12.3. A rented host's busier memory takes the
# low ends lower. PCIe 5.0 parts (H100, H200) double the link.
COPY_GBS = {"pcie4": {"pinned": (20.0, 25.0), "pageable": (8.0, 15.0)}}
COPY_GBS["pcie5"] = {"pinned": (40.0, 50.0), "pageable": (12.0, 25.0)}
PCIE5 = ("H100", "H200")
# DeepSpeed's CPU Adam streams ~16 bytes per parameter: 100-200M params/s per physical core (the ZeRO-Offload
# paper's CPU-Adam, arXiv:2101.06840, steps 1B params in ~0.2-0.3 s on a 2-socket server), and a rented GPU
# host gives each GPU 4-8 physical cores.
CPU_ADAM_PER_CORE = (1e8, 2e8)
CORES_PER_RANK = (4, 8)
CPU_COMPUTE_FLOPS = (5e9, 4e10)  # a CPU rank, no measurement: wide, run `gpuctl doctor`
DISK_WRITE_BPS = (2e8, 1e9)  # a rented node's local NVMe / network volume
# What uploading a checkpoint costs the node's CPU: bytes sent per CPU-second of the uploader (boto3's
# multipart: an MD5/SHA-256 of every part at ~0.5-1 GB/s, TLS AES-GCM at 1-2 GB/s, urllib3's copies).
UPLOAD_CPU_BPS = (1.5e8, 5e8)
GPU_ADAM_PARAMS_S = (2e10, 5e10)  # optimizer on the GPU: ~16 bytes/param read+written at HBM/GDDR speed
ENGINE_MICRO_S = (0.005, 0.03)  # DeepSpeed's hooks and bucketing per micro-step (measured: 10 ms, CPU tiny)
ENGINE_STEP_S = (0.005, 0.05)
SHORT_SEQ_TOKENS = 2048  # below this many tokens per micro-batch the GEMMs are too small to reach the MFU band


@dataclass(frozen=True)
class Rates:
    compute: Rate  # FLOP/s per rank, forward + backward
    reduce: Rate  # gradient bytes reduced per second (ZeRO-2's reduce-to-owners, after a backward)
    gather: Rate  # parameter bytes all-gathered per second
    h2d: Rate  # host -> device, as the run allocates (pinned or pageable)
    d2h: Rate
    cpu_adam: Rate  # params/s per rank
    gpu_adam: Rate
    disk: Rate  # bytes/s
    engine_micro: Rate  # seconds per micro-step (fixed cost)
    engine_step: Rate  # seconds per optimizer step
    upload_cpu: Rate  # checkpoint bytes uploaded per CPU-second of the uploader


def _busbw_to_algbw(gbs: tuple[float, float], ranks: int) -> tuple[float, float]:
    """Bytes of the whole buffer per second for a reduce-scatter or all-gather (each link carries (n-1)/n of
    it; nccl-tests' busbw is that per-link rate): busbw x n / (n-1)."""
    f = ranks / (ranks - 1) if ranks > 1 else 1.0
    return gbs[0] * 1e9 * f, gbs[1] * 1e9 * f


def table_rates(
    gpu: GpuSpec | None, peak_flops: float, mfu: tuple[float, float], tokens: int, ranks: int, pinned: bool
) -> Rates:
    """What the tables give, for a GPU (None: CPU ranks) at micro_batch x seq_len = tokens."""
    if gpu is None:
        compute = Rate(*CPU_COMPUTE_FLOPS, "FLOP/s", "assumed for a CPU rank (run `gpuctl doctor` to measure)")
        comm = Rate(2e8, 1.5e9, "B/s", "assumed for gloo between CPU ranks")
        host = Rate(math.inf, math.inf, "B/s", "CPU ranks: no device copy")
        return Rates(compute, comm, comm, host, host, _adam(), _gpu_adam(), _disk(), *_engine(), _upload_cpu())
    short = min(1.0, tokens / SHORT_SEQ_TOKENS) ** 0.5
    compute = Rate(
        peak_flops * mfu[0] * short,
        peak_flops * mfu[1] * short,
        "FLOP/s",
        f"{gpu.name} peak {peak_flops / 1e12:,.0f} TFLOP/s x {mfu[0]:.0%}-{mfu[1]:.0%} (plan's MFU band"
        + (f", x {short:.2f} for {tokens} tokens per micro-batch)" if short < 1 else ")"),
    )
    bw = BUSBW_GBS.get(gpu.name, (8.0, 16.0))
    low, high = _busbw_to_algbw(bw, ranks)
    p2p = "no P2P: through host memory" if gpu.name == "RTX 4090" else "table"
    reduce = Rate(low, high, "B/s", f"{gpu.name} busbw {bw[0]:g}-{bw[1]:g} GB/s ({p2p}), reduce to owners")
    gather = Rate(low, high, "B/s", f"{gpu.name} busbw {bw[0]:g}-{bw[1]:g} GB/s ({p2p}), all-gather")
    kind = "pinned" if pinned else "pageable"
    gen = "pcie5" if gpu.name in PCIE5 else "pcie4"
    lo, hi = COPY_GBS[gen][kind]
    copy = Rate(lo * 1e9, hi * 1e9, "B/s", f"{gen.upper()} x16, {kind} ({lo:g}-{hi:g} GB/s)")
    return Rates(compute, reduce, gather, copy, copy, _adam(), _gpu_adam(), _disk(), *_engine(), _upload_cpu())


def _adam() -> Rate:
    low, high = CPU_ADAM_PER_CORE[0] * CORES_PER_RANK[0], CPU_ADAM_PER_CORE[1] * CORES_PER_RANK[1]
    return Rate(low, high, "params/s", "assumed: CPU Adam at 100-200M params/s per core, 4-8 cores per rank")


def _gpu_adam() -> Rate:
    return Rate(*GPU_ADAM_PARAMS_S, "params/s", "assumed: fused Adam at the GPU's memory bandwidth")


def _upload_cpu() -> Rate:
    return Rate(*UPLOAD_CPU_BPS, "B/s", "assumed: 150-500 MB per CPU-second of the uploader (hashes, TLS)")


def _disk() -> Rate:
    return Rate(*DISK_WRITE_BPS, "B/s", "assumed: a rented node's disk, 0.2-1 GB/s")


def _engine() -> tuple[Rate, Rate]:
    return (
        Rate(ENGINE_MICRO_S[1], ENGINE_MICRO_S[0], "s", "assumed: DeepSpeed's per-micro-step hooks"),
        Rate(ENGINE_STEP_S[1], ENGINE_STEP_S[0], "s", "assumed: DeepSpeed's per-step bookkeeping"),
    )


# --- the doctor's figures ---------------------------------------------------------------------
def _pos(facts: Any, *path: str, zero: bool = False) -> float | None:
    """A finite number > 0 (>= 0 with zero) at path, else None."""
    for key in path:
        facts = facts.get(key) if isinstance(facts, dict) else None
    ok = isinstance(facts, (int, float)) and not isinstance(facts, bool) and math.isfinite(facts)
    return float(facts) if ok and (facts > 0 or (zero and facts == 0)) else None


def flops_per_micro(dims: ModelDims, micro: int, seq: int, checkpointing: bool) -> float:
    """Forward + backward FLOPs of one micro-batch: 6 x params per token (Kaplan et al. 2020) plus attention's
    12 x layers x seq x hidden per token (QK^T and AV, forward 4sh, backward twice that); with activation
    checkpointing the forward runs twice (x 8/6)."""
    per_token = 6 * dims.params + 12 * dims.layers * seq * dims.hidden
    return per_token * micro * seq * (8 / 6 if checkpointing else 1)


def node_rates(raw: dict[str, Any], dims: ModelDims | None, where: str, ranks: int = 1) -> dict[str, Rate]:
    """The doctor's `rates` object (trainer/doctor_rates.py + disk_write) as Rates, keyed like Rates' fields;
    only what was measured. `where` names the node for the source."""
    out: dict[str, Rate] = {}
    src = f"doctor on {where}"
    comp: dict[str, Any] = raw["compute"] if isinstance(raw.get("compute"), dict) else {}
    secs, micro, seq = _pos(comp, "seconds"), _pos(comp, "micro_batch"), _pos(comp, "seq_len")
    if secs and micro and seq and dims is not None:
        flops = flops_per_micro(dims, int(micro), int(seq), bool(comp.get("checkpointing")))
        out["compute"] = measured(
            flops / secs, "FLOP/s", f"{src}: forward+backward {secs * 1e3:,.1f} ms at {int(micro)}x{int(seq)}"
        )
    red_b, red_s, gat_s = (
        _pos(comp, "reduce", "bytes"),
        _pos(comp, "reduce", "seconds"),
        _pos(comp, "reduce", "gather_s"),
    )
    if red_b and red_s:
        out["reduce"] = measured(
            red_b / red_s, "B/s", f"{src}: {red_b / 1e6:,.1f} MB reduced after a backward in {red_s * 1e3:,.1f} ms"
        )
    if red_b and gat_s:
        out["gather"] = measured(
            red_b / gat_s, "B/s", f"{src}: {red_b / 1e6:,.1f} MB all-gathered in {gat_s * 1e3:,.1f} ms"
        )
    busbw = _pos(raw, "allreduce_busbw")
    if busbw and "reduce" not in out and ranks > 1:  # the all-reduce benchmark only: its algbw
        algbw = _busbw_to_algbw((busbw / 1e9, busbw / 1e9), ranks)[0]
        out["reduce"] = measured(algbw, "B/s", f"{src}: all-reduce busbw {busbw / 1e9:,.2f} GB/s")
        out["gather"] = measured(algbw, "B/s", f"{src}: all-reduce busbw {busbw / 1e9:,.2f} GB/s")
    micro_s, step_s = _pos(raw, "engine", "micro_s", zero=True), _pos(raw, "engine", "step_s", zero=True)
    if micro_s is not None:
        out["engine_micro"] = measured(
            micro_s, "s", f"{src}: DeepSpeed on a skeleton of the model, {micro_s * 1e3:,.1f} ms"
        )
    if step_s is not None:
        out["engine_step"] = measured(step_s, "s", f"{src}: DeepSpeed's step on the skeleton, {step_s * 1e3:,.1f} ms")
    params, adam_s = _pos(raw, "cpu_adam", "params"), _pos(raw, "cpu_adam", "seconds")
    if params and adam_s:
        threads = _pos(raw, "cpu_adam", "threads")
        out["cpu_adam"] = measured(
            params / adam_s,
            "params/s",
            f"{src}: CPU Adam, {params / 1e6:,.1f}M params in {adam_s * 1e3:,.1f} ms"
            + (f", {threads:.0f} thread(s)" if threads else ""),
        )
    up_b, up_cpu = _pos(raw, "upload", "bytes"), _pos(raw, "upload", "cpu_s")
    if up_b and up_cpu:
        out["upload_cpu"] = measured(
            up_b / up_cpu, "B/s", f"{src}: a {up_b / 2**20:,.0f} MiB put to the store took {up_cpu:,.2f} CPU-s"
        )
    disk_bps = _pos(raw, "disk", "bytes_per_s")
    if disk_bps:
        out["disk"] = measured(disk_bps, "B/s", f"{src}: {disk_bps / 1e6:,.0f} MB/s written + fsync'd")
    for way in ("h2d", "d2h"):
        for kind in ("pinned", "pageable"):
            nbytes, secs_copy = _pos(raw, "copy", "bytes"), _pos(raw, "copy", f"{way}_{kind}_s")
            if nbytes and secs_copy:
                out[f"{way}_{kind}"] = measured(
                    nbytes / secs_copy, "B/s", f"{src}: {way} {kind} {nbytes / secs_copy / 1e9:,.1f} GB/s"
                )
    return out


def merge(table: Rates, node: dict[str, Rate], pinned: bool) -> Rates:
    """The table's rates with the node's measured ones in their place (the copy rates of the run's kind)."""
    from dataclasses import replace

    kind = "pinned" if pinned else "pageable"
    fields = {k: v for k, v in node.items() if k in Rates.__dataclass_fields__}
    for way in ("h2d", "d2h"):
        if f"{way}_{kind}" in node:
            fields[way] = node[f"{way}_{kind}"]
    return replace(table, **fields)
