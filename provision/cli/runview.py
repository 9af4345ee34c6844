"""How `train` and `logs -f` show a run: a live view on a terminal (cli/live.py), plain lines on a
pipe, JSON lines with --json, job.log verbatim with -v. Plus the summary at the end of a run.

Every mode but -v draws from flows/watch.py's WatchState (metrics.jsonl, events.jsonl,
status.json); of job.log only the lines at WARNING or above are shown.
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from typing import Any

import typer

from provision.core import state
from provision.flows import job
from provision.flows.watch import Update, WatchState, watch


def _num(value: Any, fmt: str, none: str = "n/a") -> str:
    return format(value, fmt) if isinstance(value, (int, float)) else none


def step_line(rec: dict[str, Any], max_steps: int) -> str:
    """One plain line per logged step (the trainer's job.log format)."""
    text = (
        f"step {rec.get('step')}/{max_steps} loss {_num(rec.get('loss'), '.4f')} lr {_num(rec.get('lr'), '.1e')} "
        f"tok/s {_num(rec.get('tokens_per_s'), '.0f')} step_time {_num(rec.get('step_time_s'), '.2f')}s"
    )
    if rec.get("mfu") is not None:
        text += f" mfu {100 * rec['mfu']:.1f}%"
    if rec.get("peak_mem_gb"):
        text += f" mem {max(rec['peak_mem_gb']):.1f}GB"
    text += scale_text(rec, " ")
    return text


def phase_text(event: dict[str, Any]) -> str:
    detail = f": {event['detail']}" if event.get("detail") else ""
    expect = f", about {event['expect_s']:.0f} s" if event.get("expect_s") else ""
    return f"{event.get('name')}{detail}{expect}"


def checkpoint_text(event: dict[str, Any]) -> str:
    size = f" {event['bytes'] / 1e6:,.1f} MB" if isinstance(event.get("bytes"), int) else ""
    why = " (upload skipped: a newer save replaces it; uploads are slower than saves)"
    return f"checkpoint {event.get('tag')} {event.get('state')}{size}" + (
        why if event.get("state") == "superseded" else ""
    )


def superseded_text(st: WatchState) -> str:
    """The live view's note on coalesced uploads: how many saves were skipped, the last one named."""
    n = len(st.superseded)
    return f"; {n} superseded (upload skipped), last {st.superseded[-1]}" if n else ""


def wall_s(st: WatchState) -> float | None:
    status = st.status.status if st.status else {}
    start, end = status.get("started_at"), status.get("ended_at")
    return float(end) - float(start) if isinstance(start, (int, float)) and isinstance(end, (int, float)) else None


def summary_of(st: WatchState) -> dict[str, Any]:
    """The end of a run in figures: what the summary prints and --json's last line holds."""
    s = st.status.summary if st.status else {}
    mfus = [m["mfu"] for m in st.metrics if isinstance(m.get("mfu"), (int, float))]
    wall, cluster, tag = wall_s(st), st.info.cluster, s.get("last_checkpoint")
    cost = cluster.price_per_hour * wall / 3600 if cluster and cluster.price_per_hour and wall else None
    return {
        "run_id": st.info.run.run_id,
        "state": st.status.state if st.status else None,
        "exit_code": st.status.exit_code if st.status else None,
        "steps": s.get("steps", st.last.get("step")),
        "max_steps": st.info.run.max_steps,
        "first_loss": s.get("first_loss"),
        "final_loss": s.get("final_loss", st.last.get("loss")),
        "tokens_per_s": s.get("tokens_per_s"),
        "mfu": s.get("mfu", sum(mfus) / len(mfus) if mfus else None),
        "wall_s": wall,
        "cost": cost,
        "checkpoint": tag,
        "storage": st.info.storage_url,
        # the tag is the node's word: quoted, so a pasted line runs `ckpt pull` and nothing else
        "pull": shlex.join(["gpuctl", "ckpt", "pull", tag, "--hf", f"./{tag}-hf"]) if tag else None,
        "skipped_steps": _count(s.get("skipped_steps", st.last.get("skipped_steps"))),
        "error": s.get("error"),
    }


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 10**9 else None


def scale_text(rec: dict[str, Any], lead: str = "") -> str:
    """fp16's loss scale and the optimizer steps it skipped so far (empty for bf16/fp32)."""
    scale, skipped = rec.get("loss_scale"), _count(rec.get("skipped_steps"))
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        return ""
    return f"{lead}scale {scale:g}" + (f" skipped {skipped}" if skipped else "")


def no_mfu(st: WatchState) -> str:
    return "n/a (CPU ranks)" if st.info.run.accelerator == "cpu" else "n/a (no peak FLOP/s known for this GPU)"


def summary_lines(st: WatchState) -> list[str]:
    s = summary_of(st)
    code = f" (exit {s['exit_code']})" if s["exit_code"] not in (None, 0) else ""
    losses = " -> ".join(_num(v, ".4f") for v in (s["first_loss"], s["final_loss"]) if v is not None)
    lines = [
        f"run {s['run_id']} {s['state']}{code}",
        f"  steps {s['steps'] or 0}/{s['max_steps']}   loss {losses or 'n/a'}",
        f"  tokens/s {_num(s['tokens_per_s'], ',.0f')} (mean)   MFU "
        + (f"{100 * s['mfu']:.1f}%" if isinstance(s["mfu"], (int, float)) else no_mfu(st)),
        f"  wall time {_duration(s['wall_s'])}   cost "
        + (f"${s['cost']:.2f}" if s["cost"] is not None else "$0 (no price: local or own host)"),
    ]
    if s["skipped_steps"]:
        lines.append(
            f"  fp16: {s['skipped_steps']} of {s['steps'] or 0} optimizer steps skipped on overflow (loss scale)"
        )
    if s["error"]:
        lines.append(f"  error: {s['error']}")
    if s["checkpoint"]:
        lines.append(f"  checkpoint {s['checkpoint']} in {s['storage']}")
        lines.append(f"  get it as a Hugging Face model: {s['pull']}")
    return lines


def _warn(text: str) -> None:
    typer.echo(text, err=True)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "n/a"
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class PlainSink:
    """Not a terminal: plain lines, no control characters. One per phase, per logged step (each
    log_every steps), per checkpoint state and per warning; the summary at the end."""

    def update(self, st: WatchState, new: Update) -> None:
        for line in st.fresh_alerts:
            typer.echo(line)
        for event in new.events:  # phases come before the steps they precede, checkpoints after theirs
            if event.get("kind") == "phase":
                typer.echo("phase: " + phase_text(event))
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
