"""How `train` and `logs -f` show a run: a live view on a terminal (cli/live.py), plain lines on a
pipe, JSON lines with --json, job.log verbatim with -v. Plus the summary at the end of a run.

Every mode but -v draws from flows/watch.py's WatchState (metrics.jsonl, events.jsonl,
status.json); of job.log only the lines at WARNING or above are shown.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import typer

from provision.cli.run_text import (
    checkpoint_text,
    outcome_text,
    phase_text,
    step_line,
    summary_lines,
    summary_of,
)
from provision.core import state
from provision.flows import job
from provision.flows.watch import Update, WatchState, watch


def _warn(text: str) -> None:
    typer.echo(text, err=True)


class PlainSink:
    """Not a terminal: plain lines, no control characters. One per phase, per logged step (each
    log_every steps), per checkpoint state and per warning; the summary at the end."""

    def update(self, st: WatchState, new: Update) -> None:
        for line in st.fresh_alerts:
            typer.echo(line)
        for event in new.events:  # phases come before the steps they precede, checkpoints after theirs
            if event.get("kind") == "phase":
                typer.echo("phase: " + phase_text(event))
            elif event.get("kind") == "outcome":
                typer.echo("phase done: " + outcome_text(event))
        for rec in new.metrics:
            typer.echo(step_line(rec, st.info.run.max_steps))
        for event in new.events:
            if event.get("kind") == "checkpoint":
                typer.echo(checkpoint_text(event))
        if st.ended:
            for line in summary_lines(st):
                typer.echo(line)


class JsonSink:
    """--json: one JSON object a line on stdout, each with a "type": step, phase, checkpoint, log, summary."""

    def update(self, st: WatchState, new: Update) -> None:
        rows: list[dict[str, Any]] = [{"type": "log", "line": line} for line in st.fresh_alerts]
        events = [{"type": e.get("kind"), **{k: v for k, v in e.items() if k != "kind"}} for e in new.events]
        rows += [e for e in events if e["type"] == "phase"]
        rows += [{"type": "step", **rec} for rec in new.metrics]
        rows += [e for e in events if e["type"] != "phase"]
        if st.ended:
            rows.append({"type": "summary", **summary_of(st)})
        for row in rows:
            sys.stdout.write(json.dumps(row) + "\n")
        sys.stdout.flush()


def show_run(
    run: state.RunRecord,
    *,
    verbose: bool = False,
    as_json: bool = False,
    hook: job.FollowWatch | None = None,
    reconnect_s: float = 300,
) -> job.RunStatus:
    """Follow the run to its end in the mode that fits stdout; its final status. `hook` sees each
    read of the node and each failed one (flows/recover.py: is the node lost?)."""
    if verbose:  # everything: DeepSpeed's launcher and engine lines, compile output, every rank (escapes scrubbed)
        status = job.follow(run, typer.echo, watch=hook, reconnect_s=reconnect_s, say=_warn)
        typer.echo(f"run {run.run_id} {status.state}", err=True)
        return status
    if as_json:
        final = watch(run, JsonSink(), hook=hook, reconnect_s=reconnect_s)
    elif sys.stdout.isatty():
        from provision.cli.live import LiveSink

        with LiveSink(time.time()) as sink:
            final = watch(run, sink, poll_s=0.5, hook=hook, reconnect_s=reconnect_s)
    else:
        final = watch(run, PlainSink(), hook=hook, reconnect_s=reconnect_s)
    assert final.status is not None  # watch returns after at least one poll
    return final.status
