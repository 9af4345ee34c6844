"""provision.estimate.report on synthetic run dirs: steady-state tokens/s, scaling efficiency, the PNG."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from provision.estimate.report import (
    ReportError,
    RunReportInput,
    default_skip,
    load_run_metrics,
    report_markdown,
    report_png,
    run_stats,
)


def write_run(
    run_dir: Path,
    tokens_per_s: list[float],
    *,
    step_time_s: list[float] | None = None,
    peak_mem_gb: float | None = None,
    mfu: float | None = None,
    summary: dict | None = None,
    tokens_per_step: int = 24_576,
) -> Path:
    run_dir.mkdir(parents=True)
    lines = []
    for i, tps in enumerate(tokens_per_s):
        dt = step_time_s[i] if step_time_s else tokens_per_step / tps
        rec = {
            "step": i + 1,
            "loss": 10.0 / (i + 1),
            "lr": 1e-3,
            "tokens": tokens_per_step,
            "tokens_per_s": tps,
            "step_time_s": dt,
            "time": 1_700_000_000 + i,
        }
        if peak_mem_gb is not None:
            rec["peak_mem_gb"] = peak_mem_gb + 0.01 * i
        if mfu is not None:
            rec["mfu"] = mfu
        lines.append(json.dumps(rec))
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    if summary is not None:
        (run_dir / "summary.json").write_text(json.dumps(summary))
    return run_dir


def record(run_dir: Path, world: int, gpus: int | None = None, **kw) -> RunReportInput:
    return RunReportInput(
        metrics=load_run_metrics(run_dir),
        world_size=world,
        gpus=world if gpus is None else gpus,
        micro_batch=1,
        grad_accum=4,
        **kw,
    )


def table_rows(md: str) -> list[list[str]]:
    rows = [line.strip("|").split("|") for line in md.splitlines() if line.startswith("|")]
    return [[c.strip() for c in row] for row in rows[2:]]


def test_load_metrics_and_summary(tmp_path):
    run = write_run(
        tmp_path / "r1",
        [100.0] * 5,
        summary={
            "state": "succeeded",
            "steps": 5,
            "final_loss": 2.0,
            "tokens_per_s": 100.0,
            "world_size": 1,
            "extra": 1,
        },
    )
    m = load_run_metrics(run)
    assert [p.step for p in m.points] == [1, 2, 3, 4, 5]
    assert m.summary.state == "succeeded" and m.summary.world_size == 1
    assert m.run_id == "r1" and m.points[0].peak_mem_gb is None


def test_partial_last_line_and_resumed_steps(tmp_path):
    run = write_run(tmp_path / "r", [100.0, 200.0, 300.0])
    with (run / "metrics.jsonl").open("a") as f:  # a resume re-logs step 3, then a line being written
        f.write(json.dumps({"step": 3, "loss": 1.0, "tokens_per_s": 333.0, "step_time_s": 1.0}) + "\n")
        f.write('{"step": 4, "loss": 0.')
    m = load_run_metrics(run)
    assert [p.step for p in m.points] == [1, 2, 3] and m.points[-1].tokens_per_s == 333.0


def test_errors_are_clear(tmp_path):
    with pytest.raises(ReportError, match="no metrics yet"):
        load_run_metrics(tmp_path)
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 1}\n{"step": 2, "loss": 1, "tokens_per_s": 1, "step_time_s": 1}\n'
    )
    with pytest.raises(ReportError, match=r"metrics.jsonl:1: missing loss, tokens_per_s, step_time_s"):
        load_run_metrics(tmp_path)


def test_default_skip():
    assert [default_skip(n) for n in (1, 2, 5, 30, 95, 500)] == [0, 1, 1, 3, 10, 10]


def test_steady_state_excludes_warmup(tmp_path):
    # 10 steps: 2 slow warm-up steps (default skip for 10 steps is 1; pass 2 explicitly), then 1000 tok/s
    run = record(write_run(tmp_path / "one", [50.0, 400.0] + [1000.0] * 8, peak_mem_gb=21.5), world=1)
    st = run_stats(run, skip_steps=2)
    assert st.tokens_per_s == pytest.approx(1000.0) and st.steps_used == (3, 10) and st.skipped == 2
    assert st.peak_mem_gb == pytest.approx(21.59)  # the max over all steps
    default = run_stats(run)  # skips 1: the 400 tok/s step counts, weighted by its (longer) step time
    kept_time = 24_576 / 400 + 8 * 24_576 / 1000
    assert default.tokens_per_s == pytest.approx(9 * 24_576 / kept_time)


def test_steady_state_is_time_weighted(tmp_path):
    run = record(write_run(tmp_path / "w", [1.0, 100.0, 300.0], step_time_s=[9.0, 1.0, 3.0]), world=1)
    assert run_stats(run, skip_steps=1).tokens_per_s == pytest.approx((100 * 1 + 300 * 3) / 4)


def test_markdown_table_and_scaling_efficiency(tmp_path):
    one = record(write_run(tmp_path / "gpu1", [10.0] + [850.0] * 9, peak_mem_gb=22.0), world=1, train_batch_size=4)
    three = record(write_run(tmp_path / "gpu3", [30.0] + [2400.0] * 9, peak_mem_gb=18.0), world=3)
    md = report_markdown([one, three])
    rows = table_rows(md)
    assert md.splitlines()[0] == (
        "| Run | Mode | Batch size | Tokens/s | Memory per GPU | Scaling efficiency | Final loss |"
    )
    assert rows[0][:6] == [
        "gpu1",
        "1 GPU (still running or ended without summary.json)",
        "4",
        "850",
        "22.1 GB",
        "baseline",
    ]
    assert rows[1][:6] == [
        "gpu3",
        "3 GPU DP (still running or ended without summary.json)",
        "12",
        "2,400",
        "18.1 GB",
        f"{2400 / (3 * 850):.0%}",
    ]
    assert rows[1][5] == "94%"
    assert "first 1 skipped" in md


def test_explicit_baseline_cpu_runs_and_mfu(tmp_path):
    done = {"state": "succeeded"}
    base = record(write_run(tmp_path / "cpu1", [5.0] + [100.0] * 9, summary=done), world=1, gpus=0)
    cpu3 = record(
        write_run(tmp_path / "cpu3", [5.0] + [240.0] * 9, mfu=0.31, summary={"state": "failed"}), world=3, gpus=0
    )
    md = report_markdown([cpu3], baseline=base)
    row = table_rows(md)[0]
    assert row[1] == "3 CPU ranks (failed)" and row[3] == "240"
    assert row[4] == "31.0%"  # MFU column shown because a run has it
    assert row[5] == "n/a" and row[6] == "80%"
    no_base = table_rows(report_markdown([cpu3]))[0]
    assert no_base[6] == "n/a"
    labelled = table_rows(report_markdown([record(tmp_path / "cpu1", world=1, gpus=0, label="CPU smoke")]))[0]
    assert labelled[1] == "CPU smoke" and labelled[4] == "n/a"


def test_png_two_panels_expected_size(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.image

    one = record(write_run(tmp_path / "a", [10.0] + [850.0] * 9), world=1)
    three = record(write_run(tmp_path / "b", [30.0] + [2400.0] * 9), world=3)
    out = report_png([one, three], tmp_path / "out" / "report.png")
    assert out.is_file() and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width = matplotlib.image.imread(out).shape[:2]
    assert (width, height) == (1200, 450)
    small = report_png([one], tmp_path / "small.png", size_in=(6, 3), dpi=50)
    from PIL import Image

    with Image.open(small) as img:
        assert img.size == (300, 150)


def test_report_module_imports_no_heavy_deps():
    import subprocess
    import sys

    code = (
        "import sys, provision.estimate.report; bad = {'torch', 'deepspeed', 'transformers', 'matplotlib'} & "
        "set(sys.modules); assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_runs_of_both_strategies_in_one_table(tmp_path):
    runs = []
    for strategy, tps in (("deepspeed", 900.0), ("fsdp", 1000.0)):
        run_dir = write_run(tmp_path / strategy, [tps] * 4)
        (run_dir / "summary.json").write_text(json.dumps({"state": "succeeded", "strategy": strategy}))
        runs.append(record(run_dir, world=3))
    md = report_markdown(runs)
    assert md.splitlines()[0].startswith("| Run | Strategy | Mode | Batch size | Tokens/s | Memory per GPU |")
    rows = table_rows(md)
    assert [r[:2] for r in rows] == [["deepspeed", "deepspeed"], ["fsdp", "fsdp"]]
    assert [r[4] for r in rows] == ["900", "1,000"]
