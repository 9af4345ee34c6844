"""The words of a run, shared by every view (cli/runview.py's plain and JSON lines, cli/live.py's screen):
a step's line, a phase, a checkpoint, the end-of-run summary. Pure functions of flows/watch.py's records.
"""

from __future__ import annotations

import shlex
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from provision.flows.watch import WatchState


def num(value: Any, fmt: str, none: str = "n/a") -> str:
    return format(value, fmt) if isinstance(value, (int, float)) else none


def step_line(rec: dict[str, Any], max_steps: int) -> str:
    """One plain line per logged step (the trainer's job.log format)."""
    text = (
        f"step {rec.get('step')}/{max_steps} loss {num(rec.get('loss'), '.4f')} lr {num(rec.get('lr'), '.1e')} "
        f"tok/s {num(rec.get('tokens_per_s'), '.0f')} step_time {num(rec.get('step_time_s'), '.2f')}s"
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
    took = f", took {event['took_s']:.0f} s" if isinstance(event.get("took_s"), (int, float)) else ""
    return f"{event.get('name')}{detail}{expect}{took}"


def outcome_text(event: dict[str, Any]) -> str:
    """How a phase went (trainer/events.py outcome): "ops: cpu_adam cache hit"."""
    return f"{event.get('name')}: {event.get('detail')}"


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
    from provision.flows.startup_phases import measured

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
        "phases": measured(st.phases),  # seconds of each phase before the first step (flows/startup_phases.py)
        "startup_estimate": st.info.cluster.startup_estimate if st.info.cluster else None,
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
    losses = " -> ".join(num(v, ".4f") for v in (s["first_loss"], s["final_loss"]) if v is not None)
    lines = [
        f"run {s['run_id']} {s['state']}{code}",
        f"  steps {s['steps'] or 0}/{s['max_steps']}   loss {losses or 'n/a'}",
        f"  tokens/s {num(s['tokens_per_s'], ',.0f')} (mean)   MFU "
        + (f"{100 * s['mfu']:.1f}%" if isinstance(s["mfu"], (int, float)) else no_mfu(st)),
        f"  wall time {duration(s['wall_s'])}   cost "
        + (f"${s['cost']:.2f}" if s["cost"] is not None else "$0 (no price: local or own host)"),
    ]
    if s["skipped_steps"]:
        lines.append(
            f"  fp16: {s['skipped_steps']} of {s['steps'] or 0} optimizer steps skipped on overflow (loss scale)"
        )
    from provision.flows.startup_phases import startup_lines

    lines += startup_lines(st.info.run, st.info.cluster, list(st.phases))
    if s["error"]:
        lines.append(f"  error: {s['error']}")
    if s["checkpoint"]:
        lines.append(f"  checkpoint {s['checkpoint']} in {s['storage']}")
        lines.append(f"  get it as a Hugging Face model: {s['pull']}")
    return lines


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "n/a"
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"
