"""fp16 on short runs: DeepSpeed starts the dynamic loss scale at 2^16 and skips each step that overflows
while it backs off; gpuctl starts short runs lower (ds_config initial_scale_power from max_steps), and the
views show the scale and the skipped steps the node's metrics carry (loss_scale, skipped_steps)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from rich.console import Console

from provision.cli.live import figures
from provision.cli.run_text import step_line, summary_lines
from provision.core.config import GpuctlConfig
from provision.flows.render import fp16_scale_power, render_ds_config
from provision.flows.watch import Update
from tests.test_watch import _state, _status


def fp16(max_steps: int) -> dict:
    cfg = GpuctlConfig.model_validate({"train": {"precision": "fp16", "max_steps": max_steps}})
    return render_ds_config(cfg, "cuda", 3)["fp16"]


def test_short_runs_start_the_loss_scale_lower_long_runs_keep_deepspeeds():
    assert fp16(30) == fp16(30) | {"enabled": True, "initial_scale_power": 12}
    assert fp16(5000)["initial_scale_power"] == 16  # DeepSpeed's default


@given(st.integers(min_value=1, max_value=10**7), st.integers(min_value=1, max_value=10**7))
def test_the_start_power_is_bounded_and_grows_with_the_run(a, b):
    low, high = sorted((a, b))
    assert 12 <= fp16_scale_power(low) <= fp16_scale_power(high) <= 16


def test_views_show_the_scale_and_skipped_steps():
    rec = {"step": 3, "loss": 1.0, "lr": 1e-3, "tokens_per_s": 10.0, "step_time_s": 0.5}
    assert step_line(rec | {"loss_scale": 4096.0, "skipped_steps": 2}, 9).endswith("scale 4096 skipped 2")
    assert "scale" not in step_line(rec | {"loss_scale": "x", "skipped_steps": 2}, 9)  # node input: typed or nothing
    state = _state(max_steps=3)
    state.apply(Update(_status(state, "running"), [], [rec | {"loss_scale": 2048.0, "skipped_steps": 3}], []))
    console = Console(width=120, record=True)
    console.print(figures(state))
    shown = console.export_text()
    assert "fp16" in shown and "scale 2048 skipped 3" in shown
    summary = {"steps": 3, "first_loss": 5.0, "final_loss": 4.0, "skipped_steps": 3}
    state.apply(Update(_status(state, "succeeded", summary), [], [], []))
    assert "  fp16: 3 of 3 optimizer steps skipped on overflow (loss scale)" in summary_lines(state)
