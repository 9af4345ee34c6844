"""benchmarks/gpu_check.py's measurements and its report: DeepSpeed's host buffers read off its optimizer,
pinned bytes, RSS, and the side-by-side lines against plan's prediction."""

from __future__ import annotations

import os
import resource
import tempfile
from pathlib import Path

from provision.estimate.hardware import GB
from provision.estimate.node import rank_buffers
from provision.estimate.plan_result import PlanResult

BUFFERS = ("master", "staging", "grads", "grad_staging", "accum", "adam")


def measure_host_buffers(engine) -> dict[str, int]:
    """Bytes of each offload buffer DeepSpeed 0.19's ZeRO-1/2 optimizer holds on the host (plan's terms)."""
    opt = engine.optimizer
    base = getattr(opt, "optimizer", None)

    def size(tensors) -> int:
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    fp32 = list(getattr(opt, "single_partition_of_fp32_groups", []))
    staging = getattr(opt, "temp_grad_buffer_for_cpu_offload", None)
    adam = [v for st in (base.state.values() if base is not None else []) for v in st.values() if hasattr(v, "numel")]
    return {
        "master": size(fp32),
        "staging": size(getattr(opt, "param_buffer_of_bit16_for_cpu_offload_groups", [])),
        "grads": size(t.grad for t in fp32),
        "grad_staging": size([staging] if staging is not None else []),
        "accum": size(getattr(opt, "accumulated_grads_in_cpu", {}).values()),
        "adam": size(t for t in adam if t.numel() > 1),
    }


def planned_host_buffers(pred: PlanResult) -> dict[str, int]:
    _, ranks = rank_buffers(pred.input)
    r = ranks[int(os.environ.get("RANK", "0"))]
    return {k: int(sum(getattr(r, k)) if k == "accum" else getattr(r, k)) for k in BUFFERS}


def pinned_bytes() -> dict[str, float]:
    """Pinned host memory: what DeepSpeed asked to pin, and what torch's host allocator holds for it."""
    out: dict[str, float] = {}
    try:
        from deepspeed.utils import pin_memory_tracker

        out["ds_requested_gb"] = pin_memory_tracker._tracker._bytes / GB
    except (ImportError, AttributeError):
        pass
    import torch

    if torch.cuda.is_available() and hasattr(torch.cuda, "host_memory_stats"):
        stats = torch.cuda.host_memory_stats()
        out["torch_host_allocated_gb"] = stats.get("allocated_bytes.current", 0) / GB
        out["torch_host_reserved_gb"] = stats.get("reserved_bytes.current", stats.get("segment.current", 0)) / GB
    return out


def rss_gb() -> tuple[float, float]:
    """(now, peak) resident set size of this process."""
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    now = int(status.get("VmRSS", "0 kB").split()[0]) * 1024
    return now / GB, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB


def say(*parts, **kwargs) -> None:
    """Rank 0 prints (every rank runs the same steps)."""
    if os.environ.get("RANK", "0") == "0":
        print(*parts, **kwargs)


def report(res: dict) -> None:
    p = res["plan"]
    for name in BUFFERS if res["host_buffers"] else ():
        got, want = res["host_buffers"][name], p["host_buffers"][name]
        mark = "=" if got == want else "!="
        print(
            f"  rank {res['rank']} host buffer {name:13s} measured {got / GB:9.4f} GB  plan {want / GB:9.4f} GB  {mark}"
        )
    if res["rank"] != 0:
        return
    print(
        f"\nmeasured: {res['tokens_per_s']:,.0f} tokens/s, {res['tflops_per_gpu']:.1f} TFLOP/s per GPU (with "
        f"recompute), MFU {res['mfu']:.1%} of {res['peak_tflops']:g} TFLOP/s; plan "
        f"{p['tokens_per_s_low']:,.0f}-{p['tokens_per_s_high']:,.0f} tokens/s; "
        f"{res['skipped_steps']} overflow steps skipped, loss scale {res['loss_scale']}"
    )
    if "peak_allocated_gb" in res:
        print(
            f"measured: peak allocated {res['peak_allocated_gb']:.2f} GB, reserved {res['peak_reserved_gb']:.2f} GB,"
            f" device in use now {res['device_used_now_gb']:.2f} GB; plan {p['gpu_gb_per_rank']:.2f} GB per GPU "
            f"(model states {p['model_states_gb']:.2f} + buffers {p['buffers_gb']:.2f} + activations "
            f"{p['activations_gb']:.2f} + fragmentation + context)"
        )
    print(
        f"measured: host RSS {res['host_rss_gb']:.1f} GB now, {res['host_peak_rss_gb']:.1f} GB peak "
        f"({res['host_rss_after_init_gb']:.1f} after init) on rank 0; plan per node of {res['world_size']} rank(s): "
        f"steady {p['host_steady_gb']:.1f} GB, load {p['host_load_gb']:.1f} GB (processes included), "
        f"{p['host_ram_gb']:.1f} GB with the OS reserve"
    )
    pinned = ", ".join(f"{k} {v:.2f} GB" for k, v in res["pinned"].items()) or "not reported"
    print(f"measured: pinned {pinned}; plan {p['pinned_gb']:.2f} GB per node ({res['pinning']})")


def node_rates(args, pred: PlanResult) -> dict | None:
    """`gpuctl doctor`'s speed figures (trainer.doctor_rates) measured here for the check's own config; None
    with several ranks (each would want the GPUs the measurement takes)."""
    import dataclasses

    from trainer.doctor_rates import disk_write, measure

    if int(os.environ.get("WORLD_SIZE", "1")) != 1:
        return None
    dims = {k: v for k, v in dataclasses.asdict(pred.model).items() if k != "name"}
    accel = "cpu" if args.cpu_smoke else "cuda"
    request = {
        "ranks": 1,
        "accelerator": accel,
        "model": dims,
        "micro_batch": args.micro_batch,
        "seq_len": args.seq_len,
        "precision": args.precision,
        "checkpointing": not args.no_checkpointing,
        "zero_stage": args.zero_stage,
        "adam_params": pred.params if args.offload == "cpu" else None,
    }
    # the disk a run's checkpoints go to: the working folder, else (mounted read-only) the temp folder
    folder = Path.cwd() if os.access(Path.cwd(), os.W_OK) else Path(tempfile.gettempdir())
    return {"disk": disk_write(str(folder), 512), **measure(request)}


def step_check(pred: PlanResult, rates: dict | None, steady: list[float], accelerator: str) -> dict:
    """plan's step-time model for this config: the tables' and, with the node's figures, the calibrated one,
    beside the measured mean step (the steps after the warm-up)."""
    from provision.estimate.doctor_speed import raw_rates
    from provision.estimate.step_time import model_to_json, predict

    out = {
        "measured_step_s": sum(steady) / len(steady),
        "tables": model_to_json(predict(pred, accelerator=accelerator)),
    }
    if rates is not None:
        raw = raw_rates({"rates": rates})
        out["calibrated"] = model_to_json(predict(pred, accelerator=accelerator, doctor={"this node": raw}))
        out["rates"] = raw
    return out


def print_step_check(check: dict) -> None:
    seen = check["measured_step_s"]
    for kind in ("tables", "calibrated"):
        m = check.get(kind)
        if m is None:
            continue
        lo, hi = m["step_s_range"]
        print(
            f"step time, plan ({kind}): {m['step_s']:.3f} s ({lo:.3f}-{hi:.3f}), bound {m['bound']}; measured "
            f"{seen:.3f} s ({seen / m['step_s'] - 1:+.0%})"
        )
        for t in m["terms"]:
            if t["seconds"]:
                print(f"    {t['name']:16s} {t['seconds']:9.3f} s   {t['source']}")
