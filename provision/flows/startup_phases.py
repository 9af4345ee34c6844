"""A run's phases before its first step beside `up`'s estimate of them (provision/estimate/startup.py).

`up` measured two on the laptop (the cluster record): the image pull (the vendor's boot until an SSH
login works: NodeRecord.boot_s) and the node-side install (NodeRecord.install_s); the trainer reports
the rest in events.jsonl (ops with its cache hit or compile, model download, ...). The first run on a
cluster paid for `up`'s phases, so only its view and summary show them; a later run shows its own.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

from provision.core import state


class PhaseLike(Protocol):
    """flows/watch.py's Phase (named by shape: watch.py imports this module, not the other way round)."""

    name: str
    started: float
    ended: float | None
    outcome: str


PULL, INSTALL = "image pull", "node-side install"


def first_run(run: state.RunRecord, cluster: state.ClusterRecord | None) -> bool:
    """Whether this run is the cluster's first (it waited for `up`'s phases)."""
    if cluster is None or run.created_at < cluster.created_at:
        return False
    runs = [r for r in state.list_runs(cluster.name) if r.created_at >= cluster.created_at]
    return min(runs, key=lambda r: r.created_at).run_id == run.run_id if runs else True


def up_phases(cluster: state.ClusterRecord) -> dict[str, float]:
    """`up`'s measured phases, the slowest node's (every node boots and installs at once)."""
    out = {}
    for name, figures in ((PULL, [n.boot_s for n in cluster.nodes]), (INSTALL, [n.install_s for n in cluster.nodes])):
        took = max((f for f in figures if f is not None), default=None)
        if took is not None:
            out[name] = took
    return out


def setup_events(run: state.RunRecord, cluster: state.ClusterRecord | None) -> list[dict[str, Any]]:
    """`up`'s measured phases as finished phase events (the slowest node's), for the first run only."""
    if cluster is None or not first_run(run, cluster):
        return []
    details = {PULL: f"{cluster.image or 'the image'} (vendor boot to SSH login)", INSTALL: "images/bootstrap.sh"}
    out: list[dict[str, Any]] = []
    when = cluster.created_at
    for name, took in up_phases(cluster).items():
        out.append({"kind": "phase", "name": name, "detail": details[name], "time": when, "took_s": took})
        when += took
    return out


def measured(phases: Iterable[PhaseLike]) -> dict[str, float]:
    """Seconds of each finished phase, by name (a name seen twice: summed)."""
    out: dict[str, float] = {}
    for p in phases:
        if p.ended is not None:
            out[p.name] = out.get(p.name, 0.0) + max(0.0, p.ended - p.started)
    return out


def startup_lines(run: state.RunRecord, cluster: state.ClusterRecord | None, phases: list[PhaseLike]) -> list[str]:
    """The summary's lines: time to the first step measured, each estimated phase beside its estimate."""
    estimate = (cluster.startup_estimate or {}) if cluster and first_run(run, cluster) else {}
    notes = {p.name: p.outcome for p in phases if p.outcome}
    return phase_lines(estimate, measured(phases), notes)


def status_lines(run: state.RunRecord, summary: dict[str, Any]) -> list[str]:
    """`gpuctl status` of a run: the phases summary.json measured (trainer/events.py), `up`'s too on
    the cluster's first run, beside `up`'s estimate."""
    cluster = state.find_cluster(run.cluster)
    first = cluster is not None and first_run(run, cluster)
    got = {**(up_phases(cluster) if cluster and first else {}), **(summary.get("phases") or {})}
    estimate = (cluster.startup_estimate or {}) if cluster and first else {}
    return phase_lines(estimate, got, summary.get("phase_notes") or {})


def results_lines(run: state.RunRecord, results: Path) -> list[str]:
    """status_lines from the fetched summary.json (flows/job.py fetch_results), for `gpuctl report`."""
    try:
        summary = json.loads((results / "summary.json").read_text())
    except (OSError, ValueError):
        return []
    return status_lines(run, summary) if isinstance(summary, dict) else []


def phase_lines(estimate: dict[str, float], got: dict[str, float], notes: dict[str, str]) -> list[str]:
    from provision.estimate.startup import beside

    if not got and not estimate:
        return []
    total = sum(got.values())
    head = f"  before the first step: {total:,.0f} s measured" + (
        f" (up's estimate {sum(estimate.values()):,.0f} s)" if estimate else ""
    )
    shown = {name: got[name] for name in got if name in estimate}
    others = total - sum(shown.values())
    lines = [head, *beside(estimate, shown, notes)]
    if others > 0.5:
        lines.append(f"    other phases (tokenizing, ranks, DeepSpeed): {others:,.0f} s")
    return lines
