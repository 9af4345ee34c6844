"""The vocabulary of `gpuctl doctor`'s rules (estimate/doctor*.py): what the run needs of a node, how a
fact is read from the node's JSON (every value through a type check), and the rows a node's checks add."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from provision.core.checks import CheckRow, Status

GB = 1e9


@dataclass
class Needs:
    """What the run needs of each node, from gpuctl.yaml and `gpuctl plan`."""

    ranks: int
    accelerator: str  # cpu | cuda
    gpu: str | None = None  # the configured model (cloud offers), None: any
    ram_gb: float | None = None  # plan's host RAM (worst phase + OS reserve); None: model unknown to plan
    disk_gb: float | None = None  # plan's checkpoints (keep_local + 1) and model download
    offload: bool = False  # CPU Adam runs on the host
    rank_env: dict[str, str] = field(default_factory=dict)
    runtime: str = "none"
    storage: bool = True
    quick: bool = True


def get(facts: Any, *path: str) -> Any:
    for key in path:
        facts = facts.get(key) if isinstance(facts, dict) else None
    return facts


def num(facts: Any, *path: str) -> float | None:
    value = get(facts, *path)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


class Rows:
    """Collects the rows of one node."""

    def __init__(self, node: str) -> None:
        self.node = node
        self.rows: list[CheckRow] = []

    def add(self, check: str, value: str, expected: str, status: Status, fix: str = "") -> None:
        self.rows.append(CheckRow(check=check, node=self.node, value=value, expected=expected, status=status, fix=fix))

    def na(self, check: str, why: str) -> None:
        self.add(check, why, "-", "n/a")
