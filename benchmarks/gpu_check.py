#!/usr/bin/env python
"""Measure what `gpuctl plan` predicts, on one real GPU: DeepSeek-7B-shaped Llama, DeepSpeed ZeRO-2 + CPU offload.

Random init, the real dims (30 layers, hidden 4096, FFN 11008, vocab 102400; --layers shrinks the depth to fit
the host), built directly in 16-bit on the GPU (no fp32 copy), fp16, micro 1 x seq 2048, gradient
checkpointing, a few optimizer steps on random tokens. Prints tokens/s, TFLOP/s, MFU against the detected
GPU's peak (provision.estimate.plan's table) and peak memory, next to plan()'s prediction for the same config.

    python benchmarks/gpu_check.py --layers 30 --steps 6         # or: deepspeed --num_gpus 1 benchmarks/gpu_check.py
    python benchmarks/gpu_check.py --plan-only --gpu "NVIDIA H200" --layers 8   # the prediction only, no torch
    python benchmarks/gpu_check.py --cpu-smoke                   # this script's code path on CPU, tiny model

Host RAM: offload keeps 16 bytes/param of Adam state pinned on the host (110 GB for 30 layers on 1 GPU), so it
refuses up front when MemAvailable is short and says which --layers fits (--force to try anyway).
Exit codes: 0 ok, 2 cannot run here (no CUDA, missing packages, not enough host RAM).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from provision.estimate.hardware import GB, KNOWN_MODELS, PlanError
from provision.estimate.plan import PlanInput, PlanResult, plan

TINY_SMOKE = dict(hidden=256, heads=4, intermediate=688, vocab=1024)


class CannotRun(Exception):
    """This machine cannot run the check; the message is the one line to print."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 30; 2 with --cpu-smoke)")
    p.add_argument("--seq-len", type=int, default=None, help="default 2048 (128 with --cpu-smoke)")
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=6, help="optimizer steps in all, warm-up included")
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the averages")
    p.add_argument("--zero-stage", type=int, default=2, choices=(1, 2, 3))
    p.add_argument("--offload", default="cpu", choices=("cpu", "none"), help="offload_optimizer device")
    p.add_argument("--precision", default="fp16", choices=("fp16", "bf16"))
    p.add_argument("--no-checkpointing", action="store_true", help="turn gradient checkpointing off")
    p.add_argument("--gpu", default=None, help="GPU name for the peak table (default: the detected device)")
    p.add_argument("--peak-tflops", type=float, default=None, help="override the 16-bit dense peak")
    p.add_argument("--plan-only", action="store_true", help="print plan()'s prediction and exit (no torch)")
    p.add_argument("--cpu-smoke", action="store_true", help="run on CPU with a tiny-width model (tests the script)")
    p.add_argument("--force", action="store_true", help="skip the host-RAM check")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args(argv)
    args.layers = args.layers or (2 if args.cpu_smoke else 30)
    args.seq_len = args.seq_len or (128 if args.cpu_smoke else 2048)
    if args.steps <= args.warmup:
        p.error("--steps must be larger than --warmup")
    return args


def plan_for(args: argparse.Namespace, gpu_name: str, gpu_mem_gb: float | None) -> PlanResult:
    base = KNOWN_MODELS["deepseek-7b"]
    dims = dataclasses.replace(
        base, name=f"deepseek-7b-{args.layers}L", layers=args.layers, **(TINY_SMOKE if args.cpu_smoke else {})
    )
    return plan(
        PlanInput(
            model=dims,
            gpus_per_node=1,
            zero_stage=args.zero_stage,
            offload_optimizer=args.offload,
            micro_batch=args.micro_batch,
            seq_len=args.seq_len,
            gradient_checkpointing=not args.no_checkpointing,
            precision=args.precision,
            gpu=gpu_name,
            gpu_mem_gb=gpu_mem_gb,
        )
    )


def print_plan(pred: PlanResult) -> None:
    m = pred.memory
    print(
        f"plan: {pred.model.name} {pred.params / 1e6:,.1f}M params on {pred.gpu.name}: {m.total_gb:.1f} GB per GPU "
        f"(model states {m.model_states_bytes / GB:.1f}, buffers {m.buffers_gb:.1f}, activations "
        f"{m.activations_gb:.1f}, fragmentation {m.fragmentation_gb:.1f}, context {m.cuda_context_gb:.1f}) of "
        f"{pred.gpu_capacity_gb:.0f} GB -> {'fits' if pred.fits else 'does NOT fit'}"
    )
    print(
        f"plan: host RAM {pred.host_ram_gb:.1f} GB (Adam states {pred.host_adam_states_gb:.1f} GB); "
        f"{pred.tokens_per_s_low:,.0f}-{pred.tokens_per_s_high:,.0f} tokens/s at "
        f"{pred.input.mfu_low:.0%}-{pred.input.mfu_high:.0%} utilisation"
    )


def host_ram_check(args: argparse.Namespace, pred: PlanResult) -> None:
    """Offloaded Adam states are pinned: running out of host RAM gets the process killed, not an error."""
    if args.offload != "cpu" or args.force:
        return
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
    avail = int(meminfo["MemAvailable"].split()[0]) * 1024
    per_param = 16 + 2 + 2  # Adam states + fp16 staging + fp16 model copy on the host side
    need = per_param * pred.params * 1.1
    if need > avail:
        dims = pred.model
        per_layer = (pred.params - dataclasses.replace(dims, layers=0).params) / dims.layers
        fixed = pred.params - per_layer * dims.layers
        fits = max(int((avail / 1.1 / per_param - fixed) // per_layer), 0)
        raise CannotRun(
            f"gpu_check: offload needs ~{need / GB:.0f} GB host RAM for {dims.layers} layers, "
            f"{avail / GB:.0f} GB available: use --layers {fits} (or --force)"
        )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args: argparse.Namespace) -> dict:
    try:
        import torch
    except ImportError as exc:
        raise CannotRun("gpu_check: torch is not installed (pip install torch deepspeed transformers)") from exc
    if args.cpu_smoke:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        if args.precision == "fp16":
            print("gpu_check: --cpu-smoke uses bf16 (DeepSpeed's CPU accelerator has no fp16)")
            args.precision = "bf16"
        dev, gpu_name, gpu_mem = torch.device("cpu"), args.gpu or "RTX 4090", None
    else:
        if not torch.cuda.is_available():
            raise CannotRun(
                f"gpu_check: no CUDA device visible (torch {torch.__version__}, CUDA build "
                f"{torch.version.cuda or 'none'}); run it on an NVIDIA GPU machine, or use --plan-only"
            )
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(dev)
        gpu_name = args.gpu or torch.cuda.get_device_name(dev)
        gpu_mem = torch.cuda.get_device_properties(dev).total_memory / GB
    try:
        pred = plan_for(args, gpu_name, gpu_mem)
    except PlanError as exc:
        if args.peak_tflops is None:
            raise CannotRun(f"gpu_check: {exc}; pass --peak-tflops and --gpu 'RTX 4090' style name") from exc
        pred = plan_for(args, "RTX 4090", gpu_mem)
    peak = (args.peak_tflops or pred.gpu.peak_tflops_16bit) * 1e12
    print_plan(pred)
    host_ram_check(args, pred)
    try:
        import deepspeed
        import transformers
    except ImportError as exc:
        raise CannotRun(f"gpu_check: {exc.name} is not installed (pip install deepspeed transformers)") from exc

    for key, value in (
        ("RANK", "0"),
        ("LOCAL_RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", str(free_port())),
    ):
        os.environ.setdefault(key, value)
    deepspeed.init_distributed(dist_backend="gloo" if args.cpu_smoke else "nccl")
    dims = pred.model
    cfg = transformers.LlamaConfig(
        hidden_size=dims.hidden,
        intermediate_size=dims.intermediate,
        num_hidden_layers=dims.layers,
        num_attention_heads=dims.heads,
        num_key_value_heads=dims.kv_heads or dims.heads,
        vocab_size=dims.vocab,
        max_position_embeddings=max(4096, args.seq_len),
        tie_word_embeddings=False,
        use_cache=False,
        attn_implementation="sdpa",
    )
    dtype = torch.float16 if args.precision == "fp16" else torch.bfloat16
    torch.manual_seed(1234)
    t_build = time.perf_counter()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters are created in 16-bit, on the device: no fp32 copy anywhere
    try:
        with dev:
            model = transformers.LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(previous)
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params == pred.params, (n_params, pred.params)
    if not args.no_checkpointing:
        kwargs = {"use_reentrant": False}  # transformers 5 renamed the method; 4.x has only the old name
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    cuda = dev.type == "cuda"  # the same ZeRO settings as gpuctl's templates/ds_config.json.j2
    zero: dict = {
        "stage": args.zero_stage,
        "contiguous_gradients": True,
        "overlap_comm": cuda,
        "reduce_bucket_size": 200_000_000,
        "allgather_bucket_size": 200_000_000,
    }
    if args.offload == "cpu":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": cuda}
    ds_config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "weight_decay": 0.0}},
        "gradient_clipping": 1.0,
        "zero_optimization": zero,
        "steps_per_print": 10**9,
        args.precision: {"enabled": True, **({"initial_scale_power": 12} if args.precision == "fp16" else {})},
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    print(f"gpu_check: model built and DeepSpeed initialised in {time.perf_counter() - t_build:.0f} s")

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    tokens = torch.randint(0, dims.vocab, (args.micro_batch, args.seq_len), device=engine.device)
    times, losses = [], []
    for step in range(1, args.steps + 1):
        sync()
        t0 = time.perf_counter()
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(loss.detach().float().item())
        print(
            f"step {step}: loss {losses[-1]:.4f}  {times[-1]:.2f} s  "
            f"{args.micro_batch * args.seq_len / times[-1]:,.0f} tokens/s",
            flush=True,
        )

    steady = times[args.warmup :]
    tps = args.micro_batch * args.seq_len * len(steady) / sum(steady)
    hw_flops = pred.flops_per_token  # 6P, or 8P with recomputation
    result = {
        "gpu": gpu_name,
        "params": n_params,
        "layers": dims.layers,
        "seq_len": args.seq_len,
        "micro_batch": args.micro_batch,
        "zero_stage": args.zero_stage,
        "offload": args.offload,
        "precision": args.precision,
        "gradient_checkpointing": not args.no_checkpointing,
        "step_times_s": times,
        "losses": losses,
        "skipped_steps": int(getattr(engine, "skipped_steps", 0)),
        "tokens_per_s": tps,
        "tflops_per_gpu": tps * hw_flops / 1e12,
        "mfu": tps * 6 * n_params / peak,
        "peak_tflops": peak / 1e12,
        "host_peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB,
        "plan": {
            "gpu_gb_per_rank": pred.gpu_gb_per_rank,
            "model_states_gb": pred.memory.model_states_bytes / GB,
            "activations_gb": pred.memory.activations_gb,
            "buffers_gb": pred.memory.buffers_gb,
            "host_ram_gb": pred.host_ram_gb,
            "tokens_per_s_low": pred.tokens_per_s_low,
            "tokens_per_s_high": pred.tokens_per_s_high,
            "fits": pred.fits,
        },
    }
    if dev.type == "cuda":
        free, total = torch.cuda.mem_get_info(dev)
        result |= {
            "peak_allocated_gb": torch.cuda.max_memory_allocated(dev) / GB,
            "peak_reserved_gb": torch.cuda.max_memory_reserved(dev) / GB,
            "device_used_now_gb": (total - free) / GB,
        }
    return result


def report(res: dict) -> None:
    p = res["plan"]
    print(
        f"\nmeasured: {res['tokens_per_s']:,.0f} tokens/s, {res['tflops_per_gpu']:.1f} TFLOP/s per GPU (with "
        f"recompute), MFU {res['mfu']:.1%} of {res['peak_tflops']:g} TFLOP/s; plan "
        f"{p['tokens_per_s_low']:,.0f}-{p['tokens_per_s_high']:,.0f} tokens/s; "
        f"{res['skipped_steps']} overflow steps skipped"
    )
    if "peak_allocated_gb" in res:
        print(
            f"measured: peak allocated {res['peak_allocated_gb']:.2f} GB, reserved {res['peak_reserved_gb']:.2f} GB,"
            f" device in use now {res['device_used_now_gb']:.2f} GB; plan {p['gpu_gb_per_rank']:.2f} GB per GPU "
            f"(model states {p['model_states_gb']:.2f} + buffers {p['buffers_gb']:.2f} + activations "
            f"{p['activations_gb']:.2f} + fragmentation + context)"
        )
    print(
        f"measured: host peak RSS {res['host_peak_rss_gb']:.1f} GB; plan host RAM {p['host_ram_gb']:.1f} GB "
        "(DeepSpeed's estimate, x1.5 buffer factor)"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.plan_only:
            print_plan(plan_for(args, args.gpu or "RTX 4090", None))
            return 0
        res = run(args)
    except (CannotRun, PlanError) as exc:
        print(str(exc), file=sys.stderr)
        return 2
    report(res)
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
