"""The step-time model for a cluster (pure): what `up` and `train` print before the run costs money, and
what the summary puts beside the run's measured figures.

The cluster's recorded nodes decide the GPU, the ranks and CPU vs GPU; the last `gpuctl doctor` (or `up`'s
quick checks: the disk only) gives the rates it measured, the tables the rest (provision/estimate/rates.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from provision.estimate.hardware import KNOWN_MODELS, PlanError, find_gpu
from provision.estimate.sizing import plan_input

if TYPE_CHECKING:
    from provision.core.config import GpuctlConfig
    from provision.core.state import ClusterRecord
    from provision.estimate.step_time import StepModel


def cluster_model(cfg: GpuctlConfig, cluster: ClusterRecord) -> StepModel | None:
    """The step model for this config on this cluster; None when plan does not know the model (or GPU)."""
    from provision.estimate.plan import plan
    from provision.estimate.plan_input import PlanInput
    from provision.estimate.step_time import predict

    fields = plan_input(cfg)
    if fields.get("model") not in KNOWN_MODELS or not cluster.nodes:
        return None
    node = cluster.nodes[0]
    fields.update(gpus_per_node=node.slots, nodes=len(cluster.nodes))
    if node.accelerator == "cuda" and node.gpu_name:
        fields["gpu"] = node.gpu_name
    try:
        if "gpu" in fields:
            find_gpu(fields["gpu"])
        result = plan(PlanInput(**fields))
    except PlanError:
        return None
    rates = cluster.doctor.rates if cluster.doctor is not None else {}
    return predict(
        result,
        accelerator=node.accelerator,
        doctor=rates,
        checkpoint_every=cfg.train.checkpoint_every,
        max_steps=cfg.train.max_steps,
    )


def _dur(seconds: float) -> str:
    if seconds < 1:
        return f"{seconds * 1e3:,.0f} ms"
    if seconds < 120:
        return f"{seconds:,.1f} s" if seconds < 10 else f"{seconds:,.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:,.0f} min"
    return f"{seconds / 3600:,.1f} h"


def forecast_lines(model: StepModel, max_steps: int, price_per_hour: float | None) -> list[str]:
    """Predicted step time, tokens/s, time to max_steps and cost; the bound term; which rates are the node's."""
    fast, mid, slow = model.eta_s(max_steps)
    lines = [
        f"predicted: step {_dur(model.step_s)} ({_dur(model.fast_s)}-{_dur(model.slow_s)}), "
        f"{model.tokens_per_s:,.0f} tokens/s, {max_steps:,} steps in {_dur(mid)} ({_dur(fast)}-{_dur(slow)})"
        + (
            f", ${mid / 3600 * price_per_hour:,.2f} (${fast / 3600 * price_per_hour:,.2f}-"
            f"${slow / 3600 * price_per_hour:,.2f}) at ${price_per_hour:.3f}/h"
            if price_per_hour
            else ""
        ),
        f"bound by {model.bound.name} ({_dur(model.bound.seconds)} of the step); "
        + (
            f"measured on the node: {', '.join(model.measured)}"
            if model.measured
            else "every rate from plan's tables (`gpuctl doctor` measures the node's)"
        ),
    ]
    return lines


def compare(prediction: dict[str, Any], measured: dict[str, Any]) -> list[tuple[str, float, float | None]]:
    """(part, predicted s, measured s) for what the trainer times per step (metrics.jsonl means), from a
    prediction as step_time.model_to_json writes it: forward + backward (compute, gradient reduction and the
    gradients' copy to the host, DeepSpeed's per-micro-step hooks), the optimizer step (CPU Adam, the copy
    back, the all-gather, the step's bookkeeping, the upload's CPU), one save, and the step without its amortised save (the
    trainer saves after a step: step_time_s leaves the save out)."""
    by: dict[str, float] = {}
    for t in prediction.get("terms") or []:
        if isinstance(t, dict) and isinstance(t.get("seconds"), (int, float)):
            by[str(t.get("name"))] = float(t["seconds"])
    fwd_names = ["compute", "grad reduce", "offload d2h", "framework/micro"]
    # the upload's CPU time comes out of CPU Adam's (step_time.py): the optimizer step's measured time has it
    opt_names = ["cpu adam", "gpu adam", "offload h2d", "param gather", "framework/step", "upload cpu"]
    if prediction.get("strategy") == "fsdp":  # FSDP gathers (and copies in) during forward and backward
        fwd_names += ["param gather", "offload h2d"]
        opt_names = ["cpu adam", "gpu adam", "upload cpu"]
    every = prediction.get("save_every") if isinstance(prediction.get("save_every"), int) else 0
    step = sum(v for k, v in by.items() if k != "checkpoint")
    return [
        ("forward+backward", sum(by.get(k, 0.0) for k in fwd_names), measured.get("fwd_bwd_s")),
        ("optimizer step", sum(by.get(k, 0.0) for k in opt_names), measured.get("optimizer_s")),
        ("checkpoint save (one)", by.get("checkpoint", 0.0) * (every or 0), measured.get("save_s")),
        ("step (saves apart)", step, measured.get("step_time_s")),
    ]


def compare_lines(prediction: dict[str, Any], measured: dict[str, Any]) -> list[str]:
    """The comparison as text lines: part, predicted, measured, measured / predicted."""
    lines = [f"{'part':24s} {'predicted':>10s} {'measured':>10s} {'ratio':>6s}"]
    for part, pred, seen in compare(prediction, measured):
        ratio = f"{seen / pred:.2f}" if seen is not None and pred > 0 else "-"
        shown = f"{seen:.3f} s" if seen is not None else "-"
        lines.append(f"{part:24s} {pred:8.3f} s {shown:>10s} {ratio:>6s}")
    return lines


def measured_means(records: list[dict[str, Any]], saves: list[float] | None = None) -> dict[str, float]:
    """Means over the logged steps after the first (warm-up) of step_time_s, fwd_bwd_s, optimizer_s; saves'."""
    out: dict[str, float] = {}
    steady = [r for r in records if isinstance(r, dict)][1:] or [r for r in records if isinstance(r, dict)]
    for key in ("step_time_s", "fwd_bwd_s", "optimizer_s"):
        values = [float(r[key]) for r in steady if isinstance(r.get(key), (int, float))]
        if values:
            out[key] = sum(values) / len(values)
    if saves:
        out["save_s"] = sum(saves) / len(saves)
    return out


def say_forecast(cfg: GpuctlConfig, cluster: ClusterRecord, say: Any) -> StepModel | None:
    """`up` and `train`: the prediction in two lines (nothing when plan does not know the model)."""
    model = cluster_model(cfg, cluster)
    if model is not None:
        for line in forecast_lines(model, cfg.train.max_steps, cluster.price_per_hour):
            say(line)
    return model


PREDICTION_FILE = "prediction.json"  # beside the run's fetched results (state dir results/<run id>/)


def save_prediction(results: Any, model: StepModel) -> None:
    """`train` keeps what it predicted with the run, for the summary and `gpuctl report`."""
    import json
    from pathlib import Path

    from provision.estimate.step_time import model_to_json

    folder = Path(results)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / PREDICTION_FILE).write_text(json.dumps(model_to_json(model), indent=2) + "\n")


def results_comparison(results: Any) -> list[str]:
    """Predicted vs measured lines for a run's results folder; [] without a prediction or metrics."""
    import json
    from pathlib import Path

    folder = Path(results)
    try:
        prediction = json.loads((folder / PREDICTION_FILE).read_text())
        lines = (folder / "metrics.jsonl").read_text().splitlines()
    except (OSError, ValueError):
        return []
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    saves: list[float] = []
    try:
        summary = json.loads((folder / "summary.json").read_text())
        saves = [float(x) for x in summary.get("save_s") or [] if isinstance(x, (int, float))]
    except (OSError, ValueError, AttributeError):
        pass
    if not isinstance(prediction, dict) or not records:
        return []
    return compare_lines(prediction, measured_means(records, saves))


def step_apart(prediction: dict[str, Any] | None) -> tuple[float, float, float] | None:
    """A saved prediction's step without its amortised save (mid, low, high seconds): what the trainer's
    step_time_s measures (it leaves saves out). None for a prediction that lacks its terms."""
    if not isinstance(prediction, dict) or not isinstance(prediction.get("terms"), list):
        return None
    mid = low = high = 0.0
    for t in prediction["terms"]:
        span = t.get("range_s") if isinstance(t, dict) else None
        if not (isinstance(span, list) and len(span) == 2 and isinstance(t.get("seconds"), (int, float))):
            return None
        if t.get("name") != "checkpoint" and all(isinstance(x, (int, float)) for x in span):
            mid, low, high = mid + float(t["seconds"]), low + float(span[0]), high + float(span[1])
    return (mid, low, high) if mid > 0 else None


def load_prediction(run_id: str) -> dict[str, Any] | None:
    """What `train` predicted for this run (save_prediction); None when it predicted nothing."""
    import json

    from provision.core.state import state_dir

    try:
        doc = json.loads((state_dir() / "results" / run_id / PREDICTION_FILE).read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def _binding_cap(cfg: GpuctlConfig, cluster: ClusterRecord) -> tuple[str, str]:
    """The config field whose cap is the cluster's (the smaller of max_hours and max_cost at the price)."""
    prov = cfg.provider
    hours, cost = getattr(prov, "max_hours", None), getattr(prov, "max_cost", None)
    price = cluster.price_per_hour or 0.0
    by_cost = (cost - cluster.spent_cost) / price if cost and price > 0 else None
    if by_cost is not None and (not hours or by_cost < hours - cluster.spent_hours):
        return "provider.max_cost", f"${cost:,.4g} (${price:.3f}/h: {_dur(by_cost * 3600)})"
    return "provider.max_hours", f"{hours or cluster.budget_hours:g} h"


def warn_cap(cfg: GpuctlConfig, cluster: ClusterRecord, say: Any) -> None:
    """`up` before it asks to rent: the picked offers' cap against the prediction for their GPUs (plan's tables;
    the quick checks say it again with the node's own figures)."""
    model = cluster_model(cfg, cluster)
    if model is not None:
        check_cap(cfg, cluster, model, say, refuse=False)


def check_cap(cfg: GpuctlConfig, cluster: ClusterRecord, model: StepModel, say: Any, *, refuse: bool) -> None:
    """`up` and `train`: the budget cap against the time to max_steps. A cap below the prediction's high end
    may stop the run before its end (a warning); below its low end the run cannot finish, and `train`
    refuses (refuse=True): a save before the cap would be paid for and the run still not done."""
    import time

    from provision.core.errors import GpuctlError

    if not cluster.budget_hours:
        return
    steps = cfg.train.max_steps
    fast, mid, slow = model.eta_s(steps)
    left = cluster.created_at + cluster.budget_hours * 3600 - time.time()
    if slow <= left:
        return
    field, cap = _binding_cap(cfg, cluster)
    fits = max(1, int(left / model.slow_s)) if model.slow_s > 0 else 1
    what = (
        f"{field} {cap}, {_dur(max(left, 0))} left, but {steps:,} steps are predicted to take "
        f"{_dur(mid)} ({_dur(fast)}-{_dur(slow)})"
    )
    fix = f"lower train.max_steps to {fits:,} or raise {field}; `up` sets the cap: `gpuctl down` and `up` again"
    if fast > left and refuse:
        raise GpuctlError(
            f"the run cannot finish before the budget cap: {what}",
            f"lower train.max_steps to {fits:,}, or raise {field} then `gpuctl down` and `up`; --force trains anyway",
        )
    if fast > left:
        say(f"warning: the run cannot finish before the budget cap: {what}; {fix}")
    else:
        say(f"warning: the budget cap may stop the run before its end: {what}; {fix}")
