"""Xid events from the node's kernel log, parsed and classified (pure: text in, typed records out).

The NVIDIA driver reports GPU faults as kernel messages: `NVRM: Xid (PCI:0000:01:00): 79, <detail>`
(older drivers write the bus id without `PCI:`); dmesg prefixes `[  269.51]` or `[Wed Jul 31 ..]`,
journalctl `May 18 19:02:39 host kernel: `. What each code means and what to do about it follows
NVIDIA's Xid catalogue (https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html,
"Resolution Bucket (Immediate Action)"): the hardware codes below make a node unfit to rent for a
run; the others are mostly a program's own fault (a bad kernel, an out-of-bounds access) and only warn.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

XID_LINE = re.compile(r"NVRM: Xid \((?:PCI:)?([0-9A-Fa-f:.]+)\): (\d+),\s*(.*)$")

# code -> (what the catalogue calls it, what a renter does about it)
CRITICAL: dict[int, tuple[str, str]] = {
    48: ("double-bit ECC error", "reset the GPU (`nvidia-smi -r`) or rent another node"),
    63: ("ECC page retirement / row remapping recorded", "reset the GPU to apply the remap before the run"),
    64: ("ECC page retirement / row remapping failed", "the memory cannot be repaired: rent another node"),
    74: ("NVLink error", "reset the GPU; if it returns, the NVLink or NVSwitch is bad: rent another node"),
    79: ("GPU has fallen off the bus", "reboot the node; if it returns (power, riser, heat), rent another node"),
    92: ("high single-bit ECC error rate", "the memory is wearing out: rent another node"),
    94: ("contained ECC error", "restart the program on that GPU; a repeat means bad memory: rent another node"),
    95: ("uncontained ECC error", "reset the GPU (`nvidia-smi -r`) or reboot the node before the run"),
    119: ("GSP RPC timeout", "reset the GPU or reboot the node"),
    120: ("GSP error", "reset the GPU or reboot the node"),
}
# codes the catalogue puts on the program (RESTART_APP), or that follow another Xid
PROGRAM: dict[int, str] = {
    13: "graphics engine exception (a kernel's fault)",
    31: "GPU memory page fault (a kernel's out-of-bounds access)",
    43: "GPU stopped processing (a program's fault)",
    45: "preemptive cleanup after an earlier error",
    62: "internal micro-controller halt",
    109: "context switch timeout",
}


@dataclass(frozen=True)
class XidEvent:
    bus_id: str  # PCI address of the GPU, as the driver writes it
    code: int
    detail: str

    @property
    def critical(self) -> bool:
        return self.code in CRITICAL

    @property
    def meaning(self) -> str:
        if self.code in CRITICAL:
            return CRITICAL[self.code][0]
        return PROGRAM.get(self.code, "see NVIDIA's Xid catalogue")


def parse_log(text: str) -> list[XidEvent]:
    """Every `NVRM: Xid` line of a dmesg / journalctl -k text, in order; other lines are skipped."""
    events = []
    for line in text.splitlines():
        found = XID_LINE.search(line)
        if found:
            events.append(XidEvent(found.group(1), int(found.group(2)), found.group(3).strip()))
    return events


def summary(events: list[XidEvent]) -> str:
    """`79 x1 (GPU has fallen off the bus) on 0000:2b:00; ...`, the critical codes first."""
    counts: dict[tuple[int, str], int] = {}
    for e in events:
        counts[(e.code, e.bus_id)] = counts.get((e.code, e.bus_id), 0) + 1
    order = sorted(counts, key=lambda k: (k[0] not in CRITICAL, k[0], k[1]))
    return "; ".join(
        f"Xid {code} x{counts[(code, bus)]} ({XidEvent(bus, code, '').meaning}) on {bus}" for code, bus in order
    )


def fixes(events: list[XidEvent]) -> str:
    """The fix of each critical code seen, once each."""
    seen = sorted({e.code for e in events if e.critical})
    return "; ".join(f"Xid {code}: {CRITICAL[code][1]}" for code in seen)
