"""nvidia-smi's own reports, parsed (pure: text in, typed records out).

`nvidia-smi -q -x`: one <gpu> per device with product_name, the PCIe link (pci_gpu_link_info:
max_link_gen is what GPU and host agree on; newer drivers add max_device_link_gen and
max_host_link_gen, so a Gen4 card in a Gen3 slot shows as such), ECC mode and error counts.
`nvidia-smi topo -m`: a matrix of GPU pairs, each cell how the pair connects: X (self), NV#
(# bonded NVLinks), PIX, PXB, PHB, NODE, SYS (nearest to farthest over PCIe).

The XML comes from a machine gpuctl does not own: its size is bounded and a document that
declares entities is refused (what defusedxml refuses), before xml.etree sees it.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

MAX_XML_BYTES = 8 << 20
LINK_NAMES = ("NV", "PIX", "PXB", "PHB", "NODE", "SYS")  # nearest first
# Usable PCIe bandwidth per lane and direction, GB/s, after line coding (128b/130b from Gen3 on).
LANE_GBPS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}


class SmiParseError(ValueError):
    """nvidia-smi's output is not what nvidia-smi writes."""


@dataclass
class GpuInfo:
    index: int
    name: str
    bus_id: str
    link_gen: int | None  # the link's generation: GPU and host together (max_link_gen)
    device_gen: int | None  # what the card could do (max_device_link_gen), None on older drivers
    host_gen: int | None  # what the slot could do (max_host_link_gen)
    link_width: int | None  # current lanes (the width does not drop at idle the way the gen does)
    max_width: int | None
    ecc_enabled: bool | None  # None: the card has no ECC (GeForce)
    uncorrectable_errors: int  # volatile uncorrectable ECC errors since the driver loaded
    retired_pending: bool  # a page retirement or row remap waits for a reset

    @property
    def link_gbps(self) -> float | None:
        """One direction of the link, GB/s."""
        if self.link_gen is None or self.link_width is None:
            return None
        return LANE_GBPS.get(self.link_gen, 0.0) * self.link_width


@dataclass
class SmiReport:
    driver: str | None
    cuda: str | None  # the newest CUDA the driver supports
    attached: int | None
    gpus: list[GpuInfo] = field(default_factory=list)


def _text(el: ET.Element | None, path: str) -> str | None:
    found = el.find(path) if el is not None else None
    value = (found.text or "").strip() if found is not None else ""
    return value if value and value not in ("N/A", "[N/A]", "Unknown Error") else None


def _int(value: str | None) -> int | None:
    digits = re.match(r"\d+", value or "")
    return int(digits.group(0)) if digits else None


def _errors(gpu: ET.Element) -> int:
    """Volatile uncorrectable ECC errors; the element names changed across schema versions."""
    volatile = gpu.find("ecc_errors/volatile")
    if volatile is None:
        return 0
    names = ("sram_uncorrectable", "dram_uncorrectable", "double_bit/total")
    return sum(_int(_text(volatile, n)) or 0 for n in names)


def _pending(gpu: ET.Element) -> bool:
    flags = (_text(gpu, "retired_pages/pending_retirement"), _text(gpu, "remapped_rows/remapping_pending"))
    return any(f == "Yes" for f in flags if f)


def parse_query(xml_text: str) -> SmiReport:
    """`nvidia-smi -q -x` -> SmiReport; SmiParseError for anything else."""
    if len(xml_text.encode()) > MAX_XML_BYTES:
        raise SmiParseError(f"nvidia-smi XML of {len(xml_text)} characters: larger than nvidia-smi writes")
    if "<!ENTITY" in xml_text:
        raise SmiParseError("nvidia-smi XML declares entities: nvidia-smi never does")
    try:
        root = ET.fromstring(xml_text)
    except ET.ParseError as exc:
        raise SmiParseError(f"nvidia-smi XML does not parse: {exc}") from None
    if root.tag != "nvidia_smi_log":
        raise SmiParseError(f"root element {root.tag!r}, not nvidia_smi_log")
    report = SmiReport(_text(root, "driver_version"), _text(root, "cuda_version"), _int(_text(root, "attached_gpus")))
    for i, gpu in enumerate(root.findall("gpu")):
        link = gpu.find("pci/pci_gpu_link_info")
        ecc = _text(gpu, "ecc_mode/current_ecc")
        report.gpus.append(
            GpuInfo(
                index=i,
                name=_text(gpu, "product_name") or "?",
                bus_id=gpu.get("id", ""),
                link_gen=_int(_text(link, "pcie_gen/max_link_gen")),
                device_gen=_int(_text(link, "pcie_gen/max_device_link_gen")),
                host_gen=_int(_text(link, "pcie_gen/max_host_link_gen")),
                link_width=_int(_text(link, "link_widths/current_link_width")),
                max_width=_int(_text(link, "link_widths/max_link_width")),
                ecc_enabled=None if ecc is None else ecc == "Enabled",
                uncorrectable_errors=_errors(gpu),
                retired_pending=_pending(gpu),
            )
        )
    return report


def parse_topology(text: str) -> dict[tuple[int, int], str]:
    """`nvidia-smi topo -m` -> {(i, j): "PHB" | "NV12" | ...} for every GPU pair i < j."""
    lines = [line for line in text.splitlines() if line.strip()]
    header = next((line for line in lines if re.match(r"^\s+GPU0\b", line)), None)
    if header is None:
        raise SmiParseError("no GPU0 header in `nvidia-smi topo -m` output")
    columns = [c for c in re.split(r"\s+", header.strip()) if re.fullmatch(r"GPU\d+|NIC\d+|mlx\S+", c)]
    gpus = [c for c in columns if c.startswith("GPU")]
    links: dict[tuple[int, int], str] = {}
    for line in lines:
        row = re.match(r"^(GPU\d+)\s+(.*)$", line)
        if not row:
            continue
        i = int(row.group(1)[3:])
        cells = row.group(2).split()
        for col, cell in zip(columns, cells, strict=False):
            if col in gpus and cell != "X":
                j = int(col[3:])
                if not (cell.startswith("NV") or cell in LINK_NAMES):
                    raise SmiParseError(f"GPU{i}-GPU{j}: {cell!r} is no topology link")
                if i < j:
                    links[(i, j)] = cell
    if not links and len(gpus) > 1:
        raise SmiParseError("`nvidia-smi topo -m` has GPUs but no GPU-to-GPU cell")
    return links


def path_kind(cell: str) -> str:
    """What a `topo -m` cell means for NCCL's peer-to-peer path between the two GPUs."""
    if cell.startswith("NV"):
        return "NVLink"
    return {
        "PIX": "PCIe switch",
        "PXB": "PCIe switches",
        "PHB": "PCIe host bridge",
        "NODE": "PCIe host bridges",
        "SYS": "CPU socket link",
    }.get(cell, "?")


def worst_link(links: dict[tuple[int, int], str]) -> str | None:
    """The farthest connection between any two GPUs (the ring's slowest hop is on it)."""

    def rank(cell: str) -> int:
        return 0 if cell.startswith("NV") else LINK_NAMES.index(cell)

    return max(links.values(), key=rank) if links else None
