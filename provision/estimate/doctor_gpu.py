"""`gpuctl doctor`'s GPU rules: nvidia-smi's reports (parsed by provision.estimate.nvsmi) against the run.

"n/a" on CPU nodes. RTX 40-series: the driver disables peer-to-peer, so NCCL must not try it
(NCCL_P2P_DISABLE=1 and NCCL_IB_DISABLE=1, which gpuctl's rank env sets for these cards).
"""

from __future__ import annotations

import re
from typing import Any

from provision.core.checks import Status
from provision.estimate import nvsmi, xid
from provision.estimate.doctor_rows import Needs, Rows, get

RTX40 = re.compile(r"RTX 40\d0")

# --- GPUs --------------------------------------------------------------------------------------
GPU_CHECKS = ("GPUs", "driver / CUDA", "ECC errors", "Xid errors", "PCIe link", "P2P topology")


def gpu_rows(out: Rows, facts: dict[str, Any], needs: Needs) -> None:
    if needs.accelerator != "cuda":
        for check in GPU_CHECKS:
            out.na(check, "CPU ranks: no GPU used")
        if needs.runtime == "docker":
            out.na("docker --gpus all", "CPU ranks: no GPU used")
        return
    query = get(facts, "gpu", "query", "text")
    if not isinstance(query, str):
        why = get(facts, "gpu", "query", "error") or "nvidia-smi not found"
        out.add(
            "GPUs",
            f"nvidia-smi: {why}",
            f"{needs.ranks} GPUs",
            "fail",
            "install the NVIDIA driver, or rent a node with GPUs",
        )
        return
    try:
        report = nvsmi.parse_query(query)
    except nvsmi.SmiParseError as exc:
        out.add("GPUs", str(exc), f"{needs.ranks} GPUs", "fail", "run `nvidia-smi -q -x` on the node and look")
        return
    _count_row(out, report, needs)
    _driver_row(out, report, facts)
    bad = [g for g in report.gpus if g.uncorrectable_errors or g.retired_pending]
    if not any(g.ecc_enabled for g in report.gpus):
        out.na("ECC errors", "no ECC on these GPUs")
    else:
        out.add(
            "ECC errors",
            ", ".join(f"GPU{g.index}: {g.uncorrectable_errors} uncorrectable" for g in bad) or "none",
            "no uncorrectable error, no pending retirement",
            "fail" if bad else "pass",
            "a GPU with uncorrectable memory errors corrupts training: rent another node" if bad else "",
        )
    _xid_row(out, facts)
    for gpu in report.gpus:
        _link_row(out, gpu)
    _topology_row(out, facts, report, needs)
    if needs.runtime == "docker":
        out.add("docker --gpus all", f"{len(report.gpus)} GPUs seen in the container", f"{needs.ranks}", "pass")


def _count_row(out: Rows, report: nvsmi.SmiReport, needs: Needs) -> None:
    names = sorted({g.name for g in report.gpus})
    value = f"{len(report.gpus)} x {' + '.join(names) or '-'}"
    wrong_model = needs.gpu and not all(_same_gpu(needs.gpu, n) for n in names)
    status: Status = "fail" if len(report.gpus) < needs.ranks or wrong_model else "pass"
    out.add(
        "GPUs",
        value,
        f"{needs.ranks} x {needs.gpu or 'any'}",
        status,
        "" if status == "pass" else "rent a node with the GPUs gpuctl.yaml names (provider.gpu, gpus_per_node)",
    )


def _same_gpu(wanted: str, name: str) -> bool:
    def norm(s: str) -> str:
        return re.sub(r"[^a-z0-9]", "", s.lower().replace("nvidia", "").replace("geforce", ""))

    return norm(wanted) in norm(name)


def _version(text: str | None) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text or "")[:2])


def _driver_row(out: Rows, report: nvsmi.SmiReport, facts: dict[str, Any]) -> None:
    torch_cuda = get(facts, "software", "torch_cuda")
    need = torch_cuda if isinstance(torch_cuda, str) else None
    ok = need is None or (report.cuda is not None and _version(report.cuda) >= _version(need))
    out.add(
        "driver / CUDA",
        f"driver {report.driver or '?'} (CUDA {report.cuda or '?'})",
        f"CUDA >= {need} (torch's build)" if need else "-",
        "pass" if ok else "fail",
        ""
        if ok
        else f"the driver is older than torch's CUDA {need}: rent a node with a newer driver, "
        "or use an image built for an older CUDA",
    )


def _link_row(out: Rows, gpu: nvsmi.GpuInfo) -> None:
    card_gen = gpu.device_gen or gpu.link_gen
    value = f"GPU{gpu.index}: Gen{gpu.link_gen or '?'} x{gpu.link_width or '?'}"
    if gpu.host_gen and gpu.device_gen and gpu.host_gen < gpu.device_gen:
        value += f" (card Gen{gpu.device_gen}, slot Gen{gpu.host_gen})"
    narrow = gpu.link_width is not None and gpu.link_width < 16
    slow = card_gen is not None and gpu.link_gen is not None and gpu.link_gen < card_gen
    status: Status = "warn" if narrow or slow else "pass"
    out.add(
        "PCIe link",
        value,
        f"Gen{card_gen or '?'} x16",
        status,
        ""
        if status == "pass"
        else "gradients cross this link every step: a node whose slots give each GPU x16 at the "
        "card's generation (risers and splitters cut it) all-reduces faster",
    )


def _topology_row(out: Rows, facts: dict[str, Any], report: nvsmi.SmiReport, needs: Needs) -> None:
    if len(report.gpus) < 2:
        out.na("P2P topology", "one GPU")
        return
    text = get(facts, "gpu", "topo", "text")
    try:
        links = nvsmi.parse_topology(text) if isinstance(text, str) else {}
    except nvsmi.SmiParseError as exc:
        out.add("P2P topology", str(exc), "-", "warn", "run `nvidia-smi topo -m` on the node and look")
        return
    worst = nvsmi.worst_link(links) or "?"
    if any(RTX40.search(g.name) for g in report.gpus):
        off = all(needs.rank_env.get(k) == "1" for k in ("NCCL_P2P_DISABLE", "NCCL_IB_DISABLE"))
        out.add(
            "P2P topology",
            f"worst pair {worst}; RTX 40-series: the driver disables P2P",
            "NCCL_P2P_DISABLE=1, NCCL_IB_DISABLE=1",
            "pass" if off else "fail",
            ""
            if off
            else "NCCL hangs trying P2P on RTX 40-series: drop the NCCL_P2P_DISABLE / NCCL_IB_DISABLE "
            "overrides from gpuctl.yaml env (gpuctl sets both to 1)",
        )
        return
    nvlink = sum(cell.startswith("NV") for cell in links.values())
    value = f"worst pair {worst} ({nvsmi.path_kind(worst)}); {nvlink} of {len(links)} pairs over NVLink"
    if nvlink and needs.rank_env.get("NCCL_P2P_DISABLE") == "1":
        out.add(
            "P2P topology",
            value,
            "NCCL P2P on (NCCL_P2P_DISABLE unset)",
            "warn",
            "NCCL_P2P_DISABLE=1 in gpuctl.yaml env turns these NVLinks off for NCCL (it copies through host "
            "memory instead): remove it",
        )
        return
    status: Status = "warn" if worst == "SYS" else "pass"
    out.add(
        "P2P topology",
        value,
        "NVLink, or PCIe within one CPU socket",
        status,
        ""
        if status == "pass"
        else "some GPUs sit on different CPU sockets: the all-reduce crosses the socket link "
        "(expect lower bus bandwidth), prefer a node with the GPUs on one socket",
    )


def _xid_row(out: Rows, facts: dict[str, Any]) -> None:
    log = get(facts, "gpu", "xid")
    lines = get(log, "lines")
    expected = "no hardware Xid since boot"
    if not isinstance(lines, list):
        why = str(get(log, "error") or "not collected")[:200]
        fix = "read it as root on the node: `sudo dmesg | grep Xid` (or `journalctl -k | grep Xid`)"
        out.add("Xid errors", f"kernel log not readable: {why}", expected, "warn", fix)
        return
    events = xid.parse_log("\n".join(str(line) for line in lines))
    critical = [e for e in events if e.critical]
    if critical:
        out.add("Xid errors", xid.summary(events)[:300], expected, "fail", xid.fixes(critical))
    elif events:
        why = "these follow a program's own faults (a kernel's bad access): the node is fine unless they repeat"
        out.add("Xid errors", xid.summary(events)[:300], expected, "warn", why)
    else:
        out.add("Xid errors", f"none since boot ({get(log, 'source')})", expected, "pass")


def slowest_link(facts: dict[str, Any]) -> float | None:
    query = get(facts, "gpu", "query", "text")
    if not isinstance(query, str):
        return None
    try:
        speeds = [g.link_gbps for g in nvsmi.parse_query(query).gpus if g.link_gbps]
    except nvsmi.SmiParseError:
        return None
    return min(speeds) if speeds else None
