"""`gpuctl report [RUN]`: a run's (or several runs') throughput table and loss / tokens-per-second plot.

Reads what the trainer writes in a run dir (docs/CONTRACTS.md): `metrics.jsonl`, one object per step with
step, loss, lr, tokens, tokens_per_s, step_time_s, time (optionally tflops_per_gpu, mfu, peak_mem_gb), and
`summary.json` at the end. What the metrics cannot say (world size, GPUs, batch) comes from the run record,
passed in by the CLI as a `RunReportInput`.

Steady-state tokens/s: the first steps (CUDA/cuDNN warm-up, allocator growth, op JIT) are excluded: by
default the first 10% of the steps, at least 1 and at most 10, always keeping one step. Over the steps kept it
is total tokens / total time, i.e. the step-time-weighted mean of tokens_per_s (the plain mean when step times
are equal); tokens_per_s is the trainer's global figure (all ranks). Scaling efficiency of an N-GPU run
against a 1-GPU run = tokens/s_N / (N x tokens/s_1) (ranks in general, so CPU runs compare the same way).

Laptop side: no torch. matplotlib is imported inside `report_png` only, through the Agg canvas (no pyplot,
no global backend switch).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
_REQUIRED = ("step", "loss", "tokens_per_s", "step_time_s")


class ReportError(Exception):
    """A run dir that cannot be reported on (missing or malformed files, no steps yet)."""


@dataclass(frozen=True)
class MetricPoint:
    step: int
    loss: float
    tokens_per_s: float
    step_time_s: float
    lr: float | None = None
    tokens: int | None = None
    time: float | None = None
    tflops_per_gpu: float | None = None
    mfu: float | None = None
    peak_mem_gb: float | None = None


@dataclass(frozen=True)
class RunSummary:
    state: str | None = None
    steps: int | None = None
    first_loss: float | None = None
    final_loss: float | None = None
    tokens_per_s: float | None = None
    world_size: int | None = None
    last_checkpoint: str | None = None
    strategy: str | None = None  # deepspeed | fsdp; absent in summaries written before train.strategy


@dataclass(frozen=True)
class RunMetrics:
    run_dir: Path
    points: tuple[MetricPoint, ...]
    summary: RunSummary | None = None  # None while the run has not finished

    @property
    def run_id(self) -> str:
        return self.run_dir.name


@dataclass(frozen=True)
class RunReportInput:
    """One run to report: its metrics plus the facts from its record (gpuctl state)."""

    metrics: RunMetrics
    world_size: int
    gpus: int  # GPUs used in all; 0 = CPU ranks
    micro_batch: int
    grad_accum: int
    train_batch_size: int | None = None  # None: micro_batch x grad_accum x world_size
    label: str | None = None  # None: "1 GPU", "3 GPU DP", "3 CPU ranks"

    @property
    def batch_size(self) -> int:
        return self.train_batch_size or self.micro_batch * self.grad_accum * self.world_size

    @property
    def mode(self) -> str:
        if self.label:
            return self.label
        if self.gpus == 0:
            return f"{self.world_size} CPU rank{'s' if self.world_size > 1 else ''}"
        return "1 GPU" if self.world_size == 1 else f"{self.world_size} GPU DP"


@dataclass(frozen=True)
class RunStats:
    tokens_per_s: float  # steady state
    steps_used: tuple[int, int]  # first and last step averaged over
    skipped: int
    peak_mem_gb: float | None
    mfu: float | None
    final_loss: float
    scaling_efficiency: float | None = None
    notes: list[str] = field(default_factory=list)


def _opt_float(obj: dict[str, Any], key: str) -> float | None:
    value = obj.get(key)
    return None if value is None else float(value)


def load_run_metrics(run_dir: str | Path) -> RunMetrics:
    """Parse run_dir/metrics.jsonl (required) and summary.json (optional). A half-written last line is ignored;
    a step logged twice (a resumed run) keeps its last record."""
    run_dir = Path(run_dir)
    path = run_dir / METRICS_FILE
    if not path.is_file():
        raise ReportError(f"{path}: no metrics yet (the trainer writes it after the first step)")
    lines = path.read_text(encoding="utf-8").splitlines()
    by_step: dict[int, MetricPoint] = {}
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            if lineno == len(lines):  # being written right now
                break
            raise ReportError(f"{path}:{lineno}: not JSON ({exc.msg})") from exc
        if not isinstance(obj, dict):
            raise ReportError(f"{path}:{lineno}: not a JSON object")
        missing = [k for k in _REQUIRED if k not in obj]
        if missing:
            raise ReportError(f"{path}:{lineno}: missing {', '.join(missing)}")
        by_step[int(obj["step"])] = MetricPoint(
            step=int(obj["step"]),
            loss=float(obj["loss"]),
            tokens_per_s=float(obj["tokens_per_s"]),
            step_time_s=float(obj["step_time_s"]),
            lr=_opt_float(obj, "lr"),
            tokens=None if obj.get("tokens") is None else int(obj["tokens"]),
            time=_opt_float(obj, "time"),
            tflops_per_gpu=_opt_float(obj, "tflops_per_gpu"),
            mfu=_opt_float(obj, "mfu"),
            peak_mem_gb=_opt_float(obj, "peak_mem_gb"),
        )
    if not by_step:
        raise ReportError(f"{path}: no steps logged yet")
    summary = None
    spath = run_dir / SUMMARY_FILE
    if spath.is_file():
        try:
            raw = json.loads(spath.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ReportError(f"{spath}: not JSON ({exc.msg})") from exc
        known = RunSummary.__dataclass_fields__
        summary = RunSummary(**{k: v for k, v in raw.items() if k in known})
    return RunMetrics(run_dir=run_dir, points=tuple(by_step[s] for s in sorted(by_step)), summary=summary)


def default_skip(n_steps: int) -> int:
    """Warm-up steps left out of the steady state: 10% of the steps, at least 1, at most 10, keeping one."""
    return min(max(1, round(n_steps * 0.1)), 10, max(n_steps - 1, 0))


def run_stats(run: RunReportInput, skip_steps: int | None = None) -> RunStats:
    """Steady-state figures of one run (no scaling efficiency: that needs the baseline, see report_markdown)."""
    points = run.metrics.points
    skip = default_skip(len(points)) if skip_steps is None else min(max(skip_steps, 0), len(points) - 1)
    kept = points[skip:]
    total_time = sum(p.step_time_s for p in kept)
    if total_time > 0:
        tps = sum(p.tokens_per_s * p.step_time_s for p in kept) / total_time
    else:
        tps = sum(p.tokens_per_s for p in kept) / len(kept)
    mems = [p.peak_mem_gb for p in points if p.peak_mem_gb is not None]
    mfus = [p.mfu for p in kept if p.mfu is not None]
    notes = []
    summary = run.metrics.summary
    if summary is None:
        notes.append("still running or ended without summary.json")
    elif summary.state and summary.state != "succeeded":
        notes.append(summary.state)
    return RunStats(
        tokens_per_s=tps,
        steps_used=(kept[0].step, kept[-1].step),
        skipped=skip,
        peak_mem_gb=max(mems) if mems else None,
        mfu=sum(mfus) / len(mfus) if mfus else None,
        final_loss=points[-1].loss,
        notes=notes,
    )


def _pick_baseline(runs: list[RunReportInput], run: RunReportInput) -> RunReportInput | None:
    """The 1-rank run of the same kind (GPU or CPU) as `run`, if the list has one."""
    ones = [r for r in runs if r.world_size == 1 and (r.gpus == 0) == (run.gpus == 0)]
    return ones[0] if ones else None


def report_markdown(
    runs: list[RunReportInput], baseline: RunReportInput | None = None, skip_steps: int | None = None
) -> str:
    """The throughput table for one or more runs: mode, batch size, tokens/s, memory per GPU, plus scaling
    efficiency against `baseline` (default: the 1-rank run of the same kind among `runs`, when there is one)."""
    if not runs:
        raise ReportError("no runs to report")
    stats = {id(r): run_stats(r, skip_steps) for r in runs}
    if baseline is not None and id(baseline) not in stats:
        stats[id(baseline)] = run_stats(baseline, skip_steps)
    show_mfu = any(stats[id(r)].mfu is not None for r in runs)
    header = ["Run", "Mode", "Batch size", "Tokens/s", "Memory per GPU", "Scaling efficiency", "Final loss"]
    if show_mfu:
        header.insert(4, "MFU")
    show_strategy = any(r.metrics.summary is not None and r.metrics.summary.strategy for r in runs)
    if show_strategy:  # runs of both engines side by side in one table
        header.insert(1, "Strategy")
    rows = []
    for run in runs:
        st, base = stats[id(run)], baseline or _pick_baseline(runs, run)
        if base is None:
            eff = "n/a"
        elif base is run:
            eff = "baseline"
        else:
            base_tps = stats[id(base)].tokens_per_s
            ratio = run.world_size / base.world_size
            eff = f"{st.tokens_per_s / (ratio * base_tps):.0%}" if base_tps > 0 else "n/a"
        mem = "n/a" if st.peak_mem_gb is None else f"{st.peak_mem_gb:.1f} GB"
        mode = run.mode + (f" ({'; '.join(st.notes)})" if st.notes else "")
        row = [
            run.metrics.run_id,
            mode,
            str(run.batch_size),
            f"{st.tokens_per_s:,.0f}",
            mem,
            eff,
            f"{st.final_loss:.4g}",
        ]
        if show_mfu:
            row.insert(4, "n/a" if st.mfu is None else f"{st.mfu:.1%}")
        if show_strategy:
            row.insert(1, strategy_of(run))
        rows.append(row)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    notes = [
        f"{r.metrics.run_id}: steps {stats[id(r)].steps_used[0]}-{stats[id(r)].steps_used[1]} "
        f"(first {stats[id(r)].skipped} skipped as warm-up)"
        for r in runs
    ]
    lines += [
        "",
        "Tokens/s: steady-state total tokens / total step time; " + "; ".join(notes) + ".",
        "Scaling efficiency: tokens/s_N / (N x tokens/s_1).",
    ]
    return "\n".join(lines) + "\n"


def strategy_of(run: RunReportInput) -> str:
    """The run's engine; a finished run from before train.strategy existed trained with DeepSpeed."""
    summary = run.metrics.summary
    if summary is None:
        return "n/a"
    return summary.strategy or "deepspeed"


def report_png(
    runs: list[RunReportInput],
    path: str | Path,
    skip_steps: int | None = None,
    size_in: tuple[float, float] = (12.0, 4.5),
    dpi: int = 100,
) -> Path:
    """Two panels, loss over steps and tokens/s over steps (steady-state mean dashed); size_in x dpi pixels."""
    if not runs:
        raise ReportError("no runs to plot")
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ReportError("the plot needs matplotlib: pip install matplotlib (the table works without it)") from exc
    fig = Figure(figsize=size_in, dpi=dpi)
    FigureCanvasAgg(fig)
    ax_loss, ax_tps = fig.subplots(1, 2)
    for run in runs:
        pts = run.metrics.points
        steps = [p.step for p in pts]
        engine = f"{run.metrics.summary.strategy}, " if run.metrics.summary and run.metrics.summary.strategy else ""
        label = f"{engine}{run.mode} ({run.metrics.run_id})"
        ax_loss.plot(steps, [p.loss if math.isfinite(p.loss) else float("nan") for p in pts], label=label)
        (line,) = ax_tps.plot(steps, [p.tokens_per_s for p in pts], marker=".", label=label)
        mean = run_stats(run, skip_steps).tokens_per_s
        ax_tps.axhline(mean, linestyle="--", linewidth=1, color=line.get_color())
    ax_loss.set(title="Loss", xlabel="step", ylabel="loss")
    ax_tps.set(title="Throughput (dashed: steady-state mean)", xlabel="step", ylabel="tokens/s")
    ax_tps.set_ylim(bottom=0)
    for ax in (ax_loss, ax_tps):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=dpi)
    return path
