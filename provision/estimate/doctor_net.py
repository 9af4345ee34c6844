"""`gpuctl doctor`'s judgement of the all-reduce across nodes (pure).

Facts: one object per node from `python -m trainer.doctor_allreduce` ({"allreduce", "link"}), or
the one-line error of a node where it did not run. The ring's slowest hop between nodes is the
network link, so the bus bandwidth (nccl-tests' busbw) is held against the slowest node's link
speed as the kernel reports it (/sys/class/net/IFACE/speed); loopback and many virtual NICs report
none, and then the row only shows what was measured.
"""

from __future__ import annotations

from typing import Any

from provision.core.checks import CheckRow
from provision.estimate.doctor_rows import GB, get, num

LINK_SHARE = 0.5  # NCCL over sockets or RoCE reaches well above half the wire; less means something is off


def internode_row(hosts: list[str], facts: list[dict[str, Any] | str], accelerator: str) -> CheckRow:
    """One row for the whole cluster: check | nodes | algbw, busbw | against the link | status | fix."""
    first = facts[0] if isinstance(facts[0], dict) else {}
    ar = get(first, "allreduce") or {}
    size = (num(ar, "bytes") or 0) / 2**20
    label = (
        f"all-reduce across {len(hosts)} nodes ({ar.get('backend', '?')}, {ar.get('ranks', '?')} ranks, {size:.0f} MB)"
    )
    where = ", ".join(hosts)
    broken = [
        f"{host}: {fact if isinstance(fact, str) else get(fact, 'allreduce', 'error')}"
        for host, fact in zip(hosts, facts, strict=True)
        if isinstance(fact, str) or get(fact, "allreduce", "error")
    ]
    algbw, busbw = num(ar, "algbw"), num(ar, "busbw")
    if broken or algbw is None or busbw is None or ar.get("sum_ok") is not True:
        why = "; ".join(broken) or "the reduced values are wrong"
        return CheckRow(
            check=label,
            node=where,
            value=why[:300],
            expected="completes",
            status="fail",
            fix="the nodes' ranks cannot reach each other: open TCP between the nodes (firewall, security "
            "group), and name the interface they share in gpuctl.yaml env (NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME)",
        )
    value = f"algbw {algbw / GB:.2f} GB/s, busbw {busbw / GB:.2f} GB/s"
    links = [get(f, "link") for f in facts if isinstance(f, dict)]
    speeds = [num(link, "speed_mbps") for link in links]
    ifaces = sorted({str(get(link, "iface") or "?") for link in links})
    if not all(speeds):
        expected = f"- (link {', '.join(ifaces)}: the kernel reports no speed)"
        return CheckRow(check=label, node=where, value=value, expected=expected, status="pass")
    wire_gbs = min(s for s in speeds if s) / 8000  # Mb/s -> GB/s
    floor = wire_gbs * LINK_SHARE
    if accelerator != "cuda":
        expected = f"- (link {wire_gbs:.2f} GB/s; CPU ranks: gloo is not held to it)"
        return CheckRow(check=label, node=where, value=value, expected=expected, status="pass")
    ok = busbw / GB >= floor
    return CheckRow(
        check=label,
        node=where,
        value=value,
        expected=f"busbw >= {floor:.2f} GB/s (half the {wire_gbs:.2f} GB/s link, {', '.join(ifaces)})",
        status="pass" if ok else "warn",
        fix=""
        if ok
        else "slower than the nodes' link allows: NCCL may use another interface (set NCCL_SOCKET_IFNAME), "
        "NCCL_DEBUG=INFO in env shows the transport; a faster interconnect (InfiniBand/RoCE) needs NCCL_IB_DISABLE unset",
    )
