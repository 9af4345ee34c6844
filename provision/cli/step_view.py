"""The step-time model as `gpuctl plan` prints it: each term's count, rate, seconds and source."""

from __future__ import annotations

from typing import Any


def _count(amount: float, unit: str) -> str:
    if unit == "FLOP":
        return f"{amount / 1e12:,.2f} TFLOP" if amount >= 1e11 else f"{amount / 1e9:,.2f} GFLOP"
    if unit == "B":
        return f"{amount / 1e9:,.3f} GB" if amount >= 1e8 else f"{amount / 1e6:,.2f} MB"
    if unit == "params":
        return f"{amount / 1e6:,.1f}M params"
    return f"{amount:g} x"


def _rate(low: float, high: float, unit: str) -> str:
    import math

    if math.isinf(low):
        return "-"
    scale = {"FLOP/s": (1e12, "TFLOP/s"), "B/s": (1e9, "GB/s"), "params/s": (1e6, "M params/s"), "s": (1e-3, "ms")}
    div, name = scale.get(unit, (1.0, unit))
    if unit == "s":
        low, high = high, low  # a fixed cost: short to long
    return f"{low / div:,.3g}-{high / div:,.3g} {name}"


def print_step(console: Any, model: Any, max_steps: int | None) -> None:
    from rich.table import Column, Table

    from provision.estimate.forecast import forecast_lines

    table = Table(
        "term",
        Column("count per step", justify="right"),
        Column("rate", justify="right"),
        Column("seconds", justify="right"),
        "rate's source",
        title=f"step time ({model.strategy}): {model.tokens_per_step:,} tokens per step",
    )
    bound = model.bound.name
    for t in model.terms:
        secs = f"{t.seconds:,.3f}" + (f" ({t.fast_s:,.3f}-{t.slow_s:,.3f})" if t.seconds else "")
        table.add_row(
            t.name + (" (bound)" if t.name == bound else ""),
            _count(t.amount, t.unit) if t.amount else "-",
            _rate(t.rate.low, t.rate.high, t.rate.unit),
            secs,
            t.rate.source,
            style="bold" if t.name == bound else None,
        )
    table.add_row("step", "", "", f"{model.step_s:,.3f} ({model.fast_s:,.3f}-{model.slow_s:,.3f})", "", style="bold")
    console.print(table)
    for line in forecast_lines(model, max_steps or 1000, None):
        console.print(line if max_steps else line.replace("1,000 steps", "1,000 steps (no max_steps: an example)"))
