"""`gpuctl report`: the throughput table (mode, batch, tokens/s, memory per GPU, scaling) and a PNG of loss
and tokens/s, from finished runs."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from provision.cli.options import say

if TYPE_CHECKING:
    from provision.estimate.report import RunReportInput

app = typer.Typer()


def _report_input(run_id: str | None) -> RunReportInput:
    from provision.core import state
    from provision.estimate.report import RunReportInput, load_run_metrics
    from provision.flows import job

    record = state.load_run(run_id)
    metrics = load_run_metrics(job.fetch_results(record))
    gpus = record.world_size if record.accelerator == "cuda" else 0
    return RunReportInput(
        metrics=metrics,
        world_size=record.world_size,
        gpus=gpus,
        micro_batch=record.micro_batch,
        grad_accum=record.grad_accum,
        train_batch_size=record.train_batch_size,
    )


def _predictions(run_ids: list[str | None]) -> str:
    """Per run that `train` predicted: predicted vs measured per part (provision/estimate/forecast.py), and
    the phases before its first step beside `up`'s estimate (flows/startup_phases.py)."""
    from provision.core import state
    from provision.estimate.forecast import results_comparison
    from provision.flows import job
    from provision.flows.startup_phases import results_lines

    out = ""
    for run_id in run_ids:
        record = state.load_run(run_id)
        results = job.fetch_results(record)
        lines = results_comparison(results)
        if lines:
            out += (
                f"\n### {record.run_id}: predicted vs measured (mean per step)\n\n```\n" + "\n".join(lines) + "\n```\n"
            )
        phases = results_lines(record, results)
        if phases:
            out += f"\n### {record.run_id}: before the first step\n\n```\n" + "\n".join(phases) + "\n```\n"
    return out


@app.command()
def report(
    runs: Annotated[Optional[list[str]], typer.Argument(help="run ids (default: the newest)")] = None,
    baseline: Annotated[Optional[str], typer.Option(help="1-GPU run id for scaling efficiency")] = None,
    output: Annotated[Path, typer.Option("--output", "-o", help="folder for report.md and report.png")] = Path(
        "gpuctl-report"
    ),
) -> None:
    """The throughput table (mode, batch, tokens/s, memory per GPU, scaling) in Markdown, and a PNG of loss and
    tokens/s over steps."""
    from provision.estimate.report import report_markdown, report_png

    run_ids: list[str | None] = list(runs) if runs else [None]
    inputs = [_report_input(r) for r in run_ids]
    base = _report_input(baseline) if baseline else None
    output.mkdir(parents=True, exist_ok=True)
    markdown = report_markdown(inputs, baseline=base) + _predictions(run_ids)
    (output / "report.md").write_text(markdown)
    png = report_png(inputs + ([base] if base else []), output / "report.png")
    typer.echo(markdown)
    say(f"wrote {output / 'report.md'} and {png}")
