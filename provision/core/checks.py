"""What `gpuctl doctor` found, as the cluster record keeps it (provision/core/state.py's `doctor`).

One CheckRow per check and node: check | node | value | expected | status | fix. A status is
pass, warn, fail or n/a (a GPU check on a CPU node). `train` refuses a cluster whose last
doctor run has a failing row, unless --force.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field

from provision.core.errors import GpuctlError

Status = Literal["pass", "warn", "fail", "n/a"]


class CheckRow(BaseModel):
    check: str
    node: str
    value: str
    expected: str = "-"
    status: Status
    fix: str = ""


class DoctorResult(BaseModel):
    at: float = Field(default_factory=time.time)
    quick: bool = True
    rows: list[CheckRow] = Field(default_factory=list)
    # per node host: the step-time model's figures the doctor measured (provision/estimate/doctor_speed.py)
    rates: dict[str, dict[str, Any]] = Field(default_factory=dict)

    def failing(self) -> list[CheckRow]:
        return [r for r in self.rows if r.status == "fail"]

    def counts(self) -> dict[str, int]:
        out = {"pass": 0, "warn": 0, "fail": 0, "n/a": 0}
        for row in self.rows:
            out[row.status] += 1
        return out


class ChecksFailed(GpuctlError):
    """`up`'s quick checks found a failing row: the cluster stays recorded, `train` waits for a fix."""

    exit_code = 8

    def __init__(self, result: DoctorResult, cluster: str):
        rows = result.failing()
        what = "; ".join(f"{r.node}: {r.check}" for r in rows[:4])
        super().__init__(
            f"cluster {cluster} is up but failed {len(rows)} check(s): {what}",
            "fix what the table says, then `gpuctl doctor`; `gpuctl down` gives the node back; "
            "`gpuctl up --skip-doctor` skips the checks",
        )
        self.result = result
