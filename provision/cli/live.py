"""The live view of a run on a terminal (rich): a header, the phases before the first step, a
progress bar over optimizer steps with ETA, and the figures people watch while a model trains.

Everything is drawn from flows/watch.py's WatchState (metrics.jsonl, events.jsonl,
status.json). Warnings and errors from job.log, finished phases and checkpoint states are
printed above the live region, so they stay on screen (and in the scrollback).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.spinner import Spinner
from rich.table import Table
from rich.text import Text

from provision.cli.run_text import (
    checkpoint_text,
    duration,
    no_mfu,
    num,
    scale_text,
    summary_lines,
    superseded_text,
)
from provision.core.terminal import scrub

if TYPE_CHECKING:
    from rich.console import RenderableType

    from provision.flows.watch import Phase, RunInfo, Update, WatchState

SPARKS = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], width: int = 24) -> str:
    """The loss trend in block characters, newest on the right, scaled to its own min..max."""
    values = values[-width:]
    if len(values) < 2:
        return ""
    low, high = min(values), max(values)
    span = (high - low) or 1.0
    return "".join(SPARKS[min(len(SPARKS) - 1, int((v - low) / span * len(SPARKS)))] for v in values)


def header(info: RunInfo) -> Text:
    run, train, c = info.run, info.train, info.cluster
    if c is not None:
        n = len(c.nodes)
        gpu = scrub(c.nodes[0].gpu_name or ("GPU" if c.nodes[0].accelerator != "cpu" else "CPU rank"))
        where = (
            f"{c.name} ({c.provider}): {n} node{'s' * (n > 1)} x {c.nodes[0].slots} {gpu}{'s' * (c.nodes[0].slots > 1)}"
        )
    else:
        where = run.cluster
    offload = train.get("offload_optimizer")
    text = Text.assemble(("gpuctl ", "bold"), (f"run {run.run_id}", "bold cyan"), f" on {where}\n")
    text.append(
        f"model {train.get('model', '?')} · batch {run.train_batch_size} = {run.micro_batch} x {run.grad_accum} "
        f"x {run.world_size} · seq {train.get('seq_len', '?')} · {train.get('precision', '?')} · "
        f"ZeRO-{train.get('zero_stage', '?')}"
        + (f", optimizer offload {offload}" if offload and offload != "none" else ""),
        style="dim",
    )
    return text


def eta_s(st: WatchState) -> float | None:
    """Steps left x the mean time of the last logged steps (each record times one optimizer step)."""
    times = [m["step_time_s"] for m in st.metrics[-10:] if isinstance(m.get("step_time_s"), (int, float))]
    step = st.last.get("step")
    if not times or not isinstance(step, int):
        return None
    return float(max(0, st.info.run.max_steps - step) * sum(times) / len(times))


def progress(st: WatchState, started: float) -> Table:
    total, step = st.info.run.max_steps, int(st.last.get("step") or 0)
    row = Table.grid(padding=(0, 1))
    row.add_row(
        ProgressBar(total=max(total, 1), completed=step, width=40),
        Text(f"{step}/{total} steps", style="bold"),
        Text(f"{100 * step / max(total, 1):.0f}%"),
        Text(f"elapsed {duration(time.time() - started)}  ETA {duration(eta_s(st))}", style="dim"),
    )
    return row


def figures(st: WatchState) -> Table:
    last, info = st.last, st.info
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    losses = [m["loss"] for m in st.metrics if isinstance(m.get("loss"), (int, float))]
    first = f"  (first {losses[0]:.4f})" if len(losses) > 1 else ""
    grid.add_row("loss", Text.assemble((num(last.get("loss"), ".4f"), "bold green"), "  ", sparkline(losses), first))
    grid.add_row(
        "tokens/s",
        f"{num(last.get('tokens_per_s'), ',.0f')}   step time {num(last.get('step_time_s'), '.2f')} s   "
        f"MFU {num(100 * last['mfu'] if isinstance(last.get('mfu'), (int, float)) else None, '.1f', 'n/a')}"
        + ("%" if isinstance(last.get("mfu"), (int, float)) else no_mfu(st)[3:]),
    )
    planned = plan_text(st)
    if planned:
        grid.add_row("vs plan", planned)
    mem = last.get("peak_mem_gb")
    grid.add_row(
        "peak memory",
        "  ".join(f"rank{i} {gb:.1f} GB" for i, gb in enumerate(mem)) if mem else "n/a (CPU ranks: no GPU memory)",
    )
    if scale_text(last):  # fp16: the dynamic loss scale and the steps skipped while it backs off
        grid.add_row("fp16", scale_text(last))
    shown = checkpoint_text(st.checkpoint)[len("checkpoint ") :] if st.checkpoint else "none yet"
    grid.add_row("checkpoint", Text(shown + superseded_text(st)))  # the node's tag: no rich markup in it
    grid.add_row("cost", cost_text(info))
    return grid


def _secs(seconds: float) -> str:
    return f"{seconds:.3g} s"


def plan_text(st: WatchState) -> str:
    """The measured mean step (saves apart, warm-up step left out) beside what `train` predicted for this
    run; empty until a step arrives or when `train` predicted nothing (a model plan does not know)."""
    from provision.estimate.forecast import measured_means, step_apart

    planned = step_apart(st.info.prediction)
    seen = measured_means(st.metrics).get("step_time_s")
    if planned is None or seen is None:
        return ""
    mid, low, high = planned
    return f"step {_secs(seen)} mean (plan {_secs(mid)}, {low:.3g}-{high:.3g}), measured/plan {seen / mid:.2f}"


def cost_text(info: RunInfo) -> str:
    now = time.time()
    cost, left = info.cost_so_far(now), info.budget_left_s(now)
    c = info.cluster
    text = f"${cost:.2f} so far at ${c.price_per_hour:.3f}/h" if cost is not None and c else "$0 (no hourly price)"
    if left is not None and c is not None:
        money = f", ${c.price_per_hour * left / 3600:.2f}" if c.price_per_hour else ""
        text += f"   budget left {duration(max(left, 0))}{money}"
    else:
        text += "   no budget cap"
    return text


def phase_row(phase: Phase) -> RenderableType:
    took = time.time() - phase.started
    expect = f" / about {duration(phase.expect_s)}" if phase.expect_s else ""
    detail = f": {phase.detail}" if phase.detail else ""
    return Spinner("dots", Text.assemble((phase.name, "bold"), detail, (f"  {duration(took)}{expect}", "dim")))


def screen(st: WatchState, started: float) -> RenderableType:
    parts: list[Any] = [header(st.info)]
    current = st.current_phase
    if current is not None:
        parts.append(phase_row(current))
    elif not st.metrics:
        parts.append(Spinner("dots", Text("launching: DeepSpeed's launcher starts the ranks", style="bold")))
    if st.metrics or current is None:
        parts += [progress(st, started), figures(st)]
    return Panel(Group(*parts), border_style="blue", expand=False)


class LiveSink:
    """A rich Live region redrawn from the WatchState; lasting lines printed above it."""

    def __init__(self, started: float):
        self.console = Console()
        self.started = started
        self.shown_phases = 0
        self.st: WatchState | None = None
        self.live = Live(console=self.console, refresh_per_second=4, get_renderable=self._render, transient=False)

    def _render(self) -> RenderableType:
        return screen(self.st, self.started) if self.st is not None else Text("")

    def __enter__(self) -> LiveSink:
        self.live.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.live.stop()
        if self.st is not None and self.st.ended:
            style = "green" if self.st.status and self.st.status.state == "succeeded" else "red"
            self.console.print(
                Panel(Text("\n".join(summary_lines(self.st))), title="summary", border_style=style, expand=False)
            )

    def update(self, st: WatchState, new: Update) -> None:
        self.st = st
        if st.status and st.status.status.get("started_at"):
            self.started = float(st.status.status["started_at"])
        done = [p for p in st.phases if p.ended is not None][self.shown_phases :]
        for phase in done:
            took = (phase.ended or phase.started) - phase.started
            detail = f": {phase.outcome or phase.detail}" if phase.outcome or phase.detail else ""
            self.console.print(Text.assemble(("✓ ", "green"), (phase.name, "bold"), detail, (f"  {took:.1f} s", "dim")))
        self.shown_phases += len(done)
        for line in st.fresh_alerts:
            error = any(w in line.lower() for w in ("error", "traceback", "failed", "killed"))
            self.console.print(Text(line, style="bold red" if error else "yellow"))
        for event in new.events:
            if event.get("kind") == "checkpoint" and event.get("state") in ("uploading", "published", "saved"):
                self.console.print(Text(checkpoint_text(event), style="cyan"))
            elif event.get("kind") == "checkpoint" and event.get("state") == "superseded":
                self.console.print(Text(checkpoint_text(event), style="yellow"))
        self.live.refresh()
