"""The tables of `gpuctl doctor` (and of `up` when its quick checks fail), and its line in `status`."""

from __future__ import annotations

import time
from typing import Any

from provision.core.checks import DoctorResult

STYLE = {"pass": "green", "warn": "yellow", "fail": "bold red", "n/a": "dim"}


def print_checks(result: DoctorResult, *, only_failing: bool = False) -> None:
    from rich.console import Console
    from rich.table import Table

    rows = result.failing() if only_failing else result.rows
    table = Table(
        "check",
        "node",
        "value",
        "expected",
        "status",
        "fix",
        title="gpuctl doctor" + (" (quick)" if result.quick else ""),
    )
    for row in rows:
        table.add_row(row.check, row.node, row.value, row.expected, f"[{STYLE[row.status]}]{row.status}[/]", row.fix)
    console = Console(stderr=only_failing)
    console.print(table)
    console.print(summary_line(result), highlight=False)


def summary_line(result: DoctorResult) -> str:
    counts = result.counts()
    ago = int(time.time() - result.at)
    when = f"{ago // 60}m ago" if ago >= 60 else f"{ago}s ago"
    kind = "quick checks" if result.quick else "checks"
    text = ", ".join(f"{n} {status}" for status, n in counts.items() if n)
    return f"doctor ({kind}, {when}): {text}" + ("; `gpuctl doctor` for the table" if counts["fail"] else "")


def print_summary(doctor: dict[str, Any] | None) -> None:
    """The status line of the cluster's last checks (status passes the record's JSON)."""
    from rich.console import Console

    if not doctor:
        return
    result = DoctorResult.model_validate(doctor)
    console = Console()
    console.print(summary_line(result), highlight=False)
    for row in result.failing():
        console.print(f"  fail: {row.node}: {row.check}: {row.value} (fix: {row.fix})", highlight=False)
