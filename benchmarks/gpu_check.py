#!/usr/bin/env python
"""Measure what `gpuctl plan` predicts, on one real GPU: DeepSeek-7B-shaped Llama with gpuctl's own ds_config.

The ds_config is the one `gpuctl train` renders (templates/ds_config.json.j2 via provision.flows.render: ZeRO-2,
CPU offload, round_robin_gradients, fp16), with gradient accumulation 4 as in the seed run, so DeepSpeed's
host-side accumulation buffers exist. The process is set up like a trainer rank (trainer.pinning: exact-size
pinning on torch >= 2.13, else pageable; trainer.hostenv: its share of the cores). Random init, the real dims
(30 layers, hidden 4096, FFN 11008, vocab 102400; --layers shrinks the depth to fit the host), built directly
in 16-bit on the GPU, micro 1 x seq 2048, gradient checkpointing, a few optimizer steps on random tokens.
Prints beside plan()'s prediction: tokens/s, MFU; the step against plan's step-time model (tables, and calibrated
by trainer.doctor_rates measured here first); GPU memory; host RSS, pinned bytes, each offload buffer.

    python benchmarks/gpu_check.py --layers 30 --steps 6         # or: deepspeed --num_gpus 1 benchmarks/gpu_check.py
    python benchmarks/gpu_check.py --plan-only --gpu "NVIDIA H200" --layers 8   # the prediction only, no torch
    python benchmarks/gpu_check.py --cpu-smoke                   # this script's code path on CPU, tiny model
    deepspeed --num_gpus 3 benchmarks/gpu_check.py --json out.json  # 3 ranks (out.rank<R>.json each)

Host RAM: plan's figure for one rank (provision.estimate.node: offload buffers, pinning, process, OS reserve);
it refuses up front when MemAvailable is short and says which --layers fits (--force to try anyway).
Exit codes: 0 ok, 2 cannot run here (no CUDA, missing packages, not enough host RAM).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from provision.estimate.hardware import GB, KNOWN_MODELS, PlanError
from provision.estimate.plan import plan
from provision.estimate.plan_input import PlanInput
from provision.estimate.plan_result import PlanResult

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_check_report as step_report
from gpu_check_report import measure_host_buffers, pinned_bytes, planned_host_buffers, report, rss_gb, say

TINY_SMOKE = dict(hidden=256, heads=4, intermediate=688, vocab=1024)


class CannotRun(Exception):
    """This machine cannot run the check; the message is the one line to print."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 30; 2 with --cpu-smoke)")
    p.add_argument("--seq-len", type=int, default=None, help="default 2048 (128 with --cpu-smoke)")
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--grad-accum", type=int, default=4, help="micro-steps per optimizer step (the seed run: 4)")
    p.add_argument("--steps", type=int, default=6, help="optimizer steps in all, warm-up included")
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the averages")
    p.add_argument("--zero-stage", type=int, default=2, choices=(1, 2))
    p.add_argument("--offload", default="cpu", choices=("cpu", "none"), help="offload_optimizer device")
    p.add_argument("--precision", default="fp16", choices=("fp16", "bf16"))
    p.add_argument("--no-checkpointing", action="store_true", help="turn gradient checkpointing off")
    p.add_argument("--gpu", default=None, help="GPU name for the peak table (default: the detected device)")
    p.add_argument("--peak-tflops", type=float, default=None, help="override the 16-bit dense peak")
    p.add_argument("--plan-only", action="store_true", help="print plan()'s prediction and exit (no torch)")
    p.add_argument("--cpu-smoke", action="store_true", help="run on CPU with a tiny-width model (tests the script)")
    p.add_argument("--force", action="store_true", help="skip the host-RAM check")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # DeepSpeed's launcher adds it
    args = p.parse_args(argv)
    args.layers = args.layers or (2 if args.cpu_smoke else 30)
    args.seq_len = args.seq_len or (128 if args.cpu_smoke else 2048)
    if args.steps <= args.warmup:
        p.error("--steps must be larger than --warmup")
    return args


def world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def plan_for(
    args: argparse.Namespace, gpu_name: str, gpu_mem_gb: float | None, pinning: str = "exact", layers: int = 0
) -> PlanResult:
    layers, smoke = layers or args.layers, TINY_SMOKE if args.cpu_smoke else {}
    dims = dataclasses.replace(KNOWN_MODELS["deepseek-7b"], name=f"deepseek-7b-{layers}L", layers=layers, **smoke)
    return plan(
        PlanInput(
            model=dims,
            gpus_per_node=world(),
            zero_stage=args.zero_stage,
            offload_optimizer=args.offload,
            micro_batch=args.micro_batch,
            grad_accum=args.grad_accum,
            seq_len=args.seq_len,
            gradient_checkpointing=not args.no_checkpointing,
            precision=args.precision,
            gpu=gpu_name,
            gpu_mem_gb=gpu_mem_gb,
            pinning=pinning,  # type: ignore[arg-type]
        )
    )


def print_plan(pred: PlanResult) -> None:
    m, node = pred.memory, pred.node
    print(
        f"plan: {pred.model.name} {pred.params / 1e6:,.1f}M params on {pred.gpu.name}: {m.total_gb:.1f} GB per GPU "
        f"(model states {m.model_states_bytes / GB:.1f}, buffers {m.buffers_gb:.1f}, activations "
        f"{m.activations_gb:.1f}, fragmentation {m.fragmentation_gb:.1f}, context {m.cuda_context_gb:.1f}) of "
        f"{pred.gpu_capacity_gb:.0f} GB -> {'fits' if pred.fits else 'does NOT fit'}"
    )
    terms = ", ".join(f"{t.name} {t.gb:.2f}" for t in node.steady)
    print(
        f"plan: host RAM {node.ram_gb:.1f} GB (steady {node.steady_gb:.1f} = {terms}; load {node.load_gb:.1f}; "
        f"resume {node.resume_gb:.1f}; + {node.reserve_gb:g} OS), pinned {node.pinned_gb:.2f} GB ({node.pinning}); "
        f"{pred.tokens_per_s_low:,.0f}-{pred.tokens_per_s_high:,.0f} tokens/s at "
        f"{pred.input.mfu_low:.0%}-{pred.input.mfu_high:.0%} utilisation"
    )


def host_ram_check(args: argparse.Namespace, pred: PlanResult, pinning: str) -> None:
    """Offload buffers live in host RAM: running out gets the process killed, not an error."""
    if args.force:
        return
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
    avail = int(meminfo["MemAvailable"].split()[0]) * 1024
    need = pred.node.ram_gb * GB
    if need > avail:
        fits = next(
            (
                n
                for n in range(args.layers - 1, 0, -1)
                if plan_for(args, pred.gpu.name, None, pinning, n).host_ram_gb * GB <= avail
            ),
            0,
        )
        raise CannotRun(
            f"gpu_check: plan needs {need / GB:.0f} GB host RAM for {args.layers} layers, "
            f"{avail / GB:.0f} GB available: use --layers {fits} (or --force)"
        )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepare_process(args: argparse.Namespace) -> None:
    """What a trainer rank gets before torch loads (trainer/__main__.py): its cores, exact-size pinning."""
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("LOCAL_SIZE", "1"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    if args.cpu_smoke:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from trainer import hostenv, pinning

    threads = hostenv.bind_threads()
    conf = pinning.pin_env()
    print(
        f"gpu_check: rank {os.environ['RANK']} threads: {threads or 'OMP_NUM_THREADS=' + os.environ.get('OMP_NUM_THREADS', '?')}"
    )
    if conf:
        say(f"gpu_check: allocator: {conf}")


def ds_config_for(args: argparse.Namespace, accelerator: str) -> dict:
    """gpuctl's rendered ds_config for this run (one rank), pinning settled like the trainer does."""
    from provision.core.config import GpuctlConfig
    from provision.flows.render import render_ds_config
    from trainer.pinning import exact_pinning, settle_pin_memory

    train = dict(
        model="tiny",
        precision=args.precision,
        micro_batch=args.micro_batch,
        grad_accum=args.grad_accum,
        seq_len=args.seq_len,
        zero_stage=args.zero_stage,
        offload_optimizer=args.offload,
        gradient_checkpointing=not args.no_checkpointing,
        lr=1e-5,
        max_steps=args.steps,
    )
    config = render_ds_config(GpuctlConfig.model_validate({"train": train}), accelerator, world())
    config["steps_per_print"] = 10**9
    if accelerator == "cuda":
        settle_pin_memory(config, exact_pinning())
    return config


def build_model(args: argparse.Namespace, pred: PlanResult, dev):
    import torch
    import transformers

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
    torch.manual_seed(1234)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16 if args.precision == "fp16" else torch.bfloat16)
    try:  # parameters are created in 16-bit, on the device: no fp32 copy anywhere
        with dev:
            model = transformers.LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(previous)
    assert sum(p.numel() for p in model.parameters()) == pred.params
    if not args.no_checkpointing:
        kwargs = {"use_reentrant": False}  # transformers 5 renamed the method; 4.x has only the old name
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model


def device_and_plan(args: argparse.Namespace):
    import torch

    from trainer.pinning import exact_pinning

    if args.cpu_smoke:
        if args.precision == "fp16":
            say("gpu_check: --cpu-smoke uses bf16 (DeepSpeed's CPU accelerator has no fp16)")
            args.precision = "bf16"
        dev, gpu_name, gpu_mem, pinning = torch.device("cpu"), args.gpu or "RTX 4090", None, "off"
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
        pinning = "exact" if exact_pinning() else "off"
    try:
        pred = plan_for(args, gpu_name, gpu_mem, pinning)
    except PlanError as exc:
        if args.peak_tflops is None:
            raise CannotRun(f"gpu_check: {exc}; pass --peak-tflops and --gpu 'RTX 4090' style name") from exc
        pred = plan_for(args, "RTX 4090", gpu_mem, pinning)
    return dev, gpu_name, pred, pinning


def run(args: argparse.Namespace) -> dict:
    try:
        import torch
    except ImportError as exc:
        raise CannotRun("gpu_check: torch is not installed (pip install torch deepspeed transformers)") from exc
    dev, gpu_name, pred, pinning = device_and_plan(args)
    peak = (args.peak_tflops or pred.gpu.peak_tflops_16bit) * 1e12
    if os.environ.get("RANK", "0") == "0":
        print_plan(pred)
    host_ram_check(args, pred, pinning)
    rates = step_report.node_rates(args, pred)  # before this process builds its model: the GPU is the measurement's
    try:
        import deepspeed
    except ImportError as exc:
        raise CannotRun(f"gpu_check: {exc.name} is not installed (pip install deepspeed transformers)") from exc
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    deepspeed.init_distributed(dist_backend="gloo" if args.cpu_smoke else "nccl")
    if args.cpu_smoke:  # like the trainer: once every rank has mapped DeepSpeed's /dev/shm buffer, unlink it
        import torch.distributed as dist

        from trainer.distributed import unlink_shm_buffer

        dist.barrier()
        unlink_shm_buffer(int(os.environ["RANK"]))
    t_build = time.perf_counter()
    model = build_model(args, pred, dev)
    ds_config = ds_config_for(args, dev.type)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    rss_after_init = rss_gb()[0]
    say(f"gpu_check: model built and DeepSpeed initialised in {time.perf_counter() - t_build:.0f} s")
    times, losses = train_steps(args, engine, pred)
    steady = times[args.warmup :]
    tokens_per_step = args.micro_batch * args.grad_accum * args.seq_len * world()
    tps = tokens_per_step * len(steady) / sum(steady)
    rss_now, rss_peak = rss_gb()
    result = {
        "gpu": gpu_name,
        "rank": int(os.environ.get("RANK", "0")),
        "world_size": world(),
        "params": pred.params,
        "layers": pred.model.layers,
        "seq_len": args.seq_len,
        "micro_batch": args.micro_batch,
        "grad_accum": args.grad_accum,
        "zero_stage": args.zero_stage,
        "offload": args.offload,
        "precision": args.precision,
        "pinning": pinning,
        "ds_config_zero": ds_config["zero_optimization"],
        "gradient_checkpointing": not args.no_checkpointing,
        "step_times_s": times,
        "losses": losses,
        "skipped_steps": int(getattr(engine, "skipped_steps", 0)),
        "loss_scale": getattr(engine.optimizer, "loss_scale", None) if args.precision == "fp16" else None,
        "tokens_per_s": tps,
        "tflops_per_gpu": tps * pred.flops_per_token / world() / 1e12,
        "mfu": tps * 6 * pred.params / world() / peak,
        "peak_tflops": peak / 1e12,
        "host_rss_after_init_gb": rss_after_init,
        "host_rss_gb": rss_now,
        "host_peak_rss_gb": rss_peak,
        "pinned": pinned_bytes(),
        "host_buffers": measure_host_buffers(engine) if args.offload == "cpu" else {},
        "step_check": step_report.step_check(pred, rates, steady, dev.type),
        "plan": {
            "gpu_gb_per_rank": pred.gpu_gb_per_rank,
            "model_states_gb": pred.memory.model_states_bytes / GB,
            "activations_gb": pred.memory.activations_gb,
            "buffers_gb": pred.memory.buffers_gb,
            "host_ram_gb": pred.host_ram_gb,
            "host_steady_gb": pred.node.steady_gb,
            "host_load_gb": pred.node.load_gb,
            "pinned_gb": pred.node.pinned_gb,
            "host_buffers": planned_host_buffers(pred) if args.offload == "cpu" else {},
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


def train_steps(args: argparse.Namespace, engine, pred: PlanResult) -> tuple[list[float], list[float]]:
    """Optimizer steps of grad_accum micro-steps each, as the trainer runs them; (seconds, mean loss) per step."""
    import torch

    def sync() -> None:
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)

    tokens = torch.randint(0, pred.model.vocab, (args.micro_batch, args.seq_len), device=engine.device)
    times, losses = [], []
    for step in range(1, args.steps + 1):
        sync()
        t0 = time.perf_counter()
        total = 0.0
        for _ in range(args.grad_accum):
            loss = engine(input_ids=tokens, labels=tokens).loss
            engine.backward(loss)
            engine.step()
            total += loss.detach().float().item()
            del loss
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(total / args.grad_accum)
        tokens_per_step = args.micro_batch * args.grad_accum * args.seq_len * world()
        say(
            f"step {step}: loss {losses[-1]:.4f}  {times[-1]:.2f} s  {tokens_per_step / times[-1]:,.0f} tokens/s",
            flush=True,
        )
    return times, losses


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.plan_only:
            print_plan(plan_for(args, args.gpu or "RTX 4090", None))
            return 0
        prepare_process(args)
        res = run(args)
    except (CannotRun, PlanError) as exc:
        print(str(exc), file=sys.stderr)
        return 2
    report(res)
    if res["rank"] == 0:
        step_report.print_step_check(res["step_check"])
    if args.json:
        path = args.json if world() == 1 else args.json.with_suffix(f".rank{res['rank']}{args.json.suffix}")
        path.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
