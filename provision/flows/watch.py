"""Watching a run: read job.log, metrics.jsonl, events.jsonl and status.json incrementally from the
node over the existing transport, and keep what a screen needs in one WatchState.

The figures come from metrics.jsonl (one record per logged step) and events.jsonl (the trainer's
phases and checkpoint states, trainer/events.py); status.json says whether the run goes on. Of
job.log only the lines at WARNING or above reach a screen (`alert_line`); the rest stays in the
log (`gpuctl logs`, `train -v`). The views that draw a WatchState live in provision/cli/live.py.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from provision.core import state
from provision.core.errors import RemoteError
from provision.flows import job, nodedata
from provision.flows.nodedata import Tail
from provision.transport.remote import Node

__all__ = ["Tail", "Update", "WatchState", "alert_line", "watch"]  # Tail: flows/nodedata.py

# Queue states the view need not show: the run's own phases and end say as much.
QUIET_QUEUE = re.compile(r" (RUNNING|COMPLETING|COMPLETED|CONFIGURING)\b")
MIN_GAP_S = 0.1  # the shortest pause between two reads of a followed run (Feed.wait)
EVENTS_FILE = "events.jsonl"  # trainer/events.py writes it (provision never imports the trainer's modules)
# DeepSpeed's own format is "[time] [LEVEL] [file:line:func] text"; INFO lines stay in job.log.
_DS_LEVEL = re.compile(r"^\[[^]]*\] \[(\w+)\]")
_ALERT = re.compile(
    r"\b(warning|error|errors|failed|traceback|killed|exception|out of memory)\b|^\w+(Error|Exception|Warning):",
    re.IGNORECASE,
)


def alert_line(line: str) -> bool:
    """A job.log line that must reach the screen: WARNING and above, errors, tracebacks, failures."""
    level = _DS_LEVEL.match(line)
    if level:
        return level.group(1).upper() in ("WARNING", "ERROR", "CRITICAL")
    return bool(_ALERT.search(line))


@dataclass
class Update:
    """What one poll found new."""

    status: job.RunStatus
    log_lines: list[str]
    metrics: list[dict[str, Any]]
    events: list[dict[str, Any]]
    notes: list[str] = field(default_factory=list)  # warnings about what the node sent (nodedata.py)
    more: bool = False  # a read was cut at its bound: read again at once


@dataclass
class Phase:
    name: str
    detail: str
    started: float
    expect_s: float | None = None
    ended: float | None = None
    outcome: str = ""  # how it went, once known (ops: cache hit or compiled)


@dataclass
class RunInfo:
    """The header: what runs where. From the run record, its cluster record and the shipped run.json."""

    run: state.RunRecord
    cluster: state.ClusterRecord | None
    train: dict[str, Any]
    storage_url: str | None
    prediction: dict[str, Any] | None = None  # what `train` predicted for this run (estimate/forecast.py)

    @classmethod
    def of(cls, run: state.RunRecord) -> RunInfo:
        from provision.estimate.forecast import load_prediction

        try:
            spec = json.loads((Path(run.bundle_dir) / "run.json").read_text())
        except (OSError, json.JSONDecodeError):
            spec = {}
        storage = spec.get("storage") or {}
        train = spec.get("train") or {}
        return cls(run, state.find_cluster(run.cluster), train, storage.get("url"), load_prediction(run.run_id))

    @property
    def log_every(self) -> int:
        return int(self.train.get("log_every") or 1)

    def cost_so_far(self, now: float) -> float | None:
        c = self.cluster
        return c.price_per_hour * (now - c.created_at) / 3600 if c and c.price_per_hour else None

    def budget_left_s(self, now: float) -> float | None:
        c = self.cluster
        return c.created_at + c.budget_hours * 3600 - now if c and c.budget_hours else None


@dataclass
class WatchState:
    """Everything a view draws, folded from the updates."""

    info: RunInfo
    status: job.RunStatus | None = None
    metrics: list[dict[str, Any]] = field(default_factory=list)
    phases: list[Phase] = field(default_factory=list)
    checkpoint: dict[str, Any] = field(default_factory=dict)  # the newest checkpoint event
    superseded: list[str] = field(default_factory=list)  # tags whose upload a newer save replaced (not stored)
    alerts: list[str] = field(default_factory=list)
    fresh_alerts: list[str] = field(default_factory=list)  # those of the last update, scrubbed for a terminal
    noted: set[str] = field(default_factory=set)  # each warning about the node's data is shown once

    def apply(self, update: Update) -> None:
        self.status = update.status
        self.fresh_alerts = [nodedata.log_line(line) for line in update.log_lines if alert_line(line)]
        for note in update.notes + update.status.notes:
            if note not in self.noted:
                self.noted.add(note)
                self.fresh_alerts.append(note)
        self.alerts += self.fresh_alerts
        for event in update.events:
            if event.get("kind") == "phase":
                self._phase_began(event)
            elif event.get("kind") == "outcome":
                self._outcome(event)
            elif event.get("kind") == "checkpoint" and event.get("state") == "superseded":
                self.superseded.append(str(event.get("tag")))  # an older tag: the newest event stays shown
            elif event.get("kind") == "checkpoint":
                self.checkpoint = event
        if update.metrics and not self.metrics:
            self.end_phase(float(update.metrics[0].get("time") or time.time()))
        self.metrics += update.metrics
        if self.ended:  # a run that failed before its first step: its last phase ended with it
            self.end_phase(float(update.status.status.get("ended_at") or time.time()))

    def _phase_began(self, event: dict[str, Any]) -> None:
        when = float(event.get("time") or time.time())
        self.end_phase(when)
        expect = event.get("expect_s")
        self.phases.append(
            Phase(str(event.get("name")), str(event.get("detail") or ""), when, float(expect) if expect else None)
        )
        if isinstance(event.get("took_s"), (int, float)):  # `up`'s phases (flows/startup_phases.py): done
            self.phases[-1].ended = when + float(event["took_s"])

    def _outcome(self, event: dict[str, Any]) -> None:
        for phase in reversed(self.phases):
            if phase.name == event.get("name"):
                phase.outcome = str(event.get("detail") or "")
                return

    def end_phase(self, when: float) -> None:
        if self.phases and self.phases[-1].ended is None:
            self.phases[-1].ended = when

    @property
    def current_phase(self) -> Phase | None:
        return self.phases[-1] if self.phases and self.phases[-1].ended is None else None

    @property
    def last(self) -> dict[str, Any]:
        return self.metrics[-1] if self.metrics else {}

    @property
    def ended(self) -> bool:
        return self.status is not None and self.status.state in job.TERMINAL


class Sink(Protocol):
    def update(self, st: WatchState, new: Update) -> None: ...


@dataclass
class Feed:
    """The run's files on its first node, each read incrementally and checked (flows/nodedata.py)."""

    run: state.RunRecord
    log: Tail = field(init=False)
    metrics: Tail = field(init=False)
    events: Tail = field(init=False)
    warned: set[str] = field(default_factory=set)  # files whose skipped lines were reported (once each)
    queue: str | None = None  # the scheduler's last word (provider slurm), shown as a phase when it changes
    setup: list[dict[str, Any]] = field(default_factory=list)  # `up`'s phases, shown with the first poll

    def __post_init__(self) -> None:
        from provision.flows.startup_phases import setup_events

        self.setup = setup_events(self.run, state.find_cluster(self.run.cluster))
        d = self.run.run_dir
        self.log, self.metrics, self.events = (
            Tail(f"{d}/job.log"),
            Tail(f"{d}/metrics.jsonl"),
            Tail(f"{d}/{EVENTS_FILE}"),
        )

    def poll(self, node: Node) -> Update:
        status = job.read_status(self.run, node)  # first: once it is terminal, the reads below are complete
        log = self.log.read(node)
        metrics, bad_metrics = nodedata.parse_lines(nodedata.NodeMetric, self.metrics.read(node))
        events, bad_events = nodedata.parse_lines(nodedata.NodeEvent, self.events.read(node))
        notes = []
        for name, bad in (("metrics.jsonl", bad_metrics), ("events.jsonl", bad_events)):
            if bad and name not in self.warned:
                self.warned.add(name)
                notes.append(f"warning: {name} from the node has lines that are no valid record, skipped ({bad[0]})")
        events = self.setup + events  # `up`'s phases come first, once
        self.setup = []
        if status.queue and status.queue != self.queue and not QUIET_QUEUE.search(status.queue):
            events.insert(0, {"kind": "phase", "name": "slurm", "detail": status.queue, "time": time.time()})
        self.queue = status.queue or self.queue
        more = self.log.more or self.metrics.more or self.events.more
        return Update(status, log, metrics, events, notes, more)

    def wait(self, link: job.Link, seconds: float) -> None:
        """Until the node wrote to the log, the metrics or the events (a stat every 50 ms over the
        open connection), at most `seconds`: a step reaches the screen as it is written. At least
        MIN_GAP_S between polls: a run that writes ten steps a second is not read ten times a
        second. Without a connection, or when a look fails, the plain wait: the next read
        reconnects and reports."""
        tails = (self.log, self.metrics, self.events)
        time.sleep(min(MIN_GAP_S, seconds))
        if link.node is None:
            time.sleep(max(0.0, seconds - MIN_GAP_S))
            return
        try:
            link.node.wait_for_growth({t.path: t.offset for t in tails}, max(0.0, seconds - MIN_GAP_S))
        except RemoteError:
            pass


def watch(
    run: state.RunRecord,
    sink: Sink,
    *,
    until_end: bool = True,
    poll_s: float = 0.5,
    reconnect_s: float = 300,
    node_for: Callable[[state.RunRecord], Node] = job.node_of,
    hook: job.FollowWatch | None = None,
) -> WatchState:
    """Feed the sink every change of the run from its start; with until_end, until the run ends.

    A dropped connection is retried until reconnect_s passes without a successful read (the
    offsets are kept, so nothing is shown twice).
    """
    feed, st = Feed(run), WatchState(RunInfo.of(run))
    link = job.Link(run, reconnect_s, hook, node_for)
    try:
        while True:
            update = link.read(feed.poll)
            if update is None:
                continue
            st.apply(update)
            sink.update(st, update)
            if not until_end or (st.ended and not update.more):
                return st
            if not update.more:
                feed.wait(link, poll_s)
    finally:
        link.close()
