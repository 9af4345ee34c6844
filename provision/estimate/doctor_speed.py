"""The doctor's speed figures (trainer/doctor_rates.py): kept for the step-time model, and judged as rows.

`raw_rates` keeps the numbers of the node's `rates` object that the model reads (provision/estimate/rates.py
node_rates), nothing else: the cluster record stores node output, so only known keys holding finite
numbers (or booleans) get there. `speed_rows` adds the doctor table's rows: CPU Adam throughput, disk
write rate, host<->device copy pinned and pageable (GPU nodes), forward+backward and gradient reduction.
"""

from __future__ import annotations

import math
from typing import Any

from provision.estimate.doctor_rows import Needs, Rows, get, num

SHAPE: dict[str, tuple[str, ...]] = {
    "compute": ("seconds", "micro_batch", "seq_len", "layers", "checkpointing"),
    "engine": ("micro_s", "step_s", "tensors"),
    "cpu_adam": ("params", "seconds", "threads"),
    "copy": ("bytes", "h2d_pinned_s", "d2h_pinned_s", "h2d_pageable_s", "d2h_pageable_s"),
    "disk": ("bytes", "seconds", "bytes_per_s"),
    "upload": ("bytes", "cpu_s"),
}
MIN_DISK_MBPS = 100.0  # a 7B save (~100 GB on node 0) takes over 15 minutes below this
MIN_PINNED_GBS = 15.0  # PCIe 4.0 x16 moves ~24 GB/s pinned; under 15 the link runs narrower (x8) or older (Gen3)
MIN_PAGEABLE_GBS = 5.0
MIN_ADAM_PARAMS_S = 1e8  # a 7B share of 2.3B params then takes over 20 s a step


def _clean(value: Any, key: str = "") -> Any:
    """A finite number >= 0 (a flag for `checkpointing`), else None."""
    if isinstance(value, bool):
        return value if key == "checkpointing" else None
    if isinstance(value, (int, float)) and math.isfinite(value) and value >= 0:
        return value
    return None


def raw_rates(facts: dict[str, Any]) -> dict[str, Any]:
    """The known numeric figures of facts["rates"] (+ the all-reduce's busbw); errors as one line each."""
    rates = get(facts, "rates")
    out: dict[str, Any] = {}
    if not isinstance(rates, dict):
        return out
    for name, keys in SHAPE.items():
        block = rates.get(name)
        if not isinstance(block, dict):
            continue
        if isinstance(block.get("error"), str):
            out[name] = {"error": block["error"][:300]}
            continue
        kept = {k: _clean(block.get(k), k) for k in keys if _clean(block.get(k), k) is not None}
        red = block.get("reduce")
        if name == "compute" and isinstance(red, dict):
            kept["reduce"] = {k: _clean(red.get(k)) for k in ("bytes", "seconds", "gather_s") if _clean(red.get(k))}
        out[name] = kept
    busbw = num(facts, "allreduce", "busbw")
    if busbw:
        out["allreduce_busbw"] = busbw
    return out


def speed_rows(out: Rows, facts: dict[str, Any], needs: Needs) -> None:
    rates = raw_rates(facts)
    _disk(out, rates)
    if needs.quick:
        return
    _adam(out, rates, needs)
    _copy(out, rates, needs)
    comp = rates.get("compute")
    if isinstance(comp, dict) and "error" in comp:
        out.add(
            "forward+backward (model shape)", comp["error"][:200], "runs", "warn", "see the error; plan uses its tables"
        )
    elif isinstance(comp, dict) and num(comp, "seconds"):
        red = get(comp, "reduce") or {}
        value = f"{num(comp, 'seconds') * 1e3:,.1f} ms at {comp.get('micro_batch')}x{comp.get('seq_len')}"  # type: ignore[operator]
        if num(red, "bytes") and num(red, "seconds"):
            value += f"; grads reduced at {num(red, 'bytes') / num(red, 'seconds') / 1e9:,.2f} GB/s"  # type: ignore[operator]
        out.add("forward+backward (model shape)", value, "measured (plan's step time)", "pass")


def _disk(out: Rows, rates: dict[str, Any]) -> None:
    disk = rates.get("disk")
    if not isinstance(disk, dict):
        return
    if "error" in disk:
        out.add(
            "disk write rate", disk["error"][:200], "writable", "warn", "check the workdir's disk: checkpoints go there"
        )
        return
    bps = num(disk, "bytes_per_s")
    if bps is None:
        return
    ok = bps / 1e6 >= MIN_DISK_MBPS
    out.add(
        "disk write rate",
        f"{bps / 1e6:,.0f} MB/s ({(num(disk, 'bytes') or 0) / 2**20:,.0f} MB, fsync'd)",
        f">= {MIN_DISK_MBPS:g} MB/s",
        "pass" if ok else "warn",
        "" if ok else "checkpoint saves will stall the run: put provider.workdir on a local NVMe disk",
    )


def _adam(out: Rows, rates: dict[str, Any], needs: Needs) -> None:
    adam = rates.get("cpu_adam")
    if not needs.offload:
        return
    if not isinstance(adam, dict):
        out.na("CPU Adam throughput", "not measured (plan does not know the model)")
        return
    if "error" in adam:
        out.add(
            "CPU Adam throughput", adam["error"][:200], "runs", "fail", "the CPU Adam op does not run: see the op row"
        )
        return
    params, secs = num(adam, "params"), num(adam, "seconds")
    if not (params and secs):
        return
    rate = params / secs
    ok = rate >= MIN_ADAM_PARAMS_S
    threads = num(adam, "threads")
    out.add(
        "CPU Adam throughput",
        f"{rate / 1e6:,.0f}M params/s per rank ({params / 1e6:,.1f}M params"
        + (f", {threads:.0f} thread(s))" if threads else ")"),
        f">= {MIN_ADAM_PARAMS_S / 1e6:,.0f}M params/s",
        "pass" if ok else "warn",
        "" if ok else "the optimizer step will bound the run: more cores per GPU, or fewer ranks per node",
    )


def _copy(out: Rows, rates: dict[str, Any], needs: Needs) -> None:
    copy = rates.get("copy")
    if needs.accelerator != "cuda":
        out.na("host<->device copy", "CPU ranks")
        return
    if not isinstance(copy, dict) or "error" in copy:
        why = copy.get("error", "not measured") if isinstance(copy, dict) else "not measured"
        out.add("host<->device copy", str(why)[:200], "measured", "warn", "see the error; plan uses its PCIe table")
        return
    nbytes = num(copy, "bytes")
    for kind, floor in (("pinned", MIN_PINNED_GBS), ("pageable", MIN_PAGEABLE_GBS)):
        h2d, d2h = num(copy, f"h2d_{kind}_s"), num(copy, f"d2h_{kind}_s")
        if not (nbytes and h2d and d2h):
            continue
        up, down = nbytes / h2d / 1e9, nbytes / d2h / 1e9
        ok = min(up, down) >= floor
        out.add(
            f"host<->device copy ({kind})",
            f"h2d {up:,.1f} GB/s, d2h {down:,.1f} GB/s",
            f">= {floor:g} GB/s",
            "pass" if ok else "warn",
            ""
            if ok
            else "the offload traffic will be slow: check the PCIe rows (link width, generation) and other load",
        )
