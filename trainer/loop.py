"""The training loop: set up, then steps of grad_accum micro-steps, logging and checkpoints.

Read it top to bottom: train() builds everything, train_step() is one optimizer step.
DeepSpeed owns the optimizer, LR scheduler, precision and ZeRO (all from ds_config).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator

from trainer.checkpoint import Checkpointer, Position, open_store, resume
from trainer.config import DistEnv, RunConfig, TrainerError
from trainer.dataset import PackedTokens, Sampler, cache_path, micro_slice, resolve_data, tokenize_to_file
from trainer.metrics import MetricsLog, StepRecord, peak_tflops, throughput, write_summary
from trainer.model import build_model, count_params
from trainer.tokenizer import load_tokenizer


def log0(env: DistEnv, message: str) -> None:
    if env.is_main:
        print(f"trainer: {message}", flush=True)


def dist_backend() -> str:
    accel = get_accelerator()
    return "gloo" if accel.device_name() == "cpu" else accel.communication_backend_name()


def ds_precision(ds_config: dict) -> str:
    if ds_config.get("bf16", {}).get("enabled"):
        return "bf16"
    if ds_config.get("fp16", {}).get("enabled"):
        return "fp16"
    return "fp32"


def load_data(cfg: RunConfig, env: DistEnv, tokenizer) -> PackedTokens:
    """Local rank 0 tokenizes once into a token file; every rank memory-maps it."""
    source = resolve_data(cfg.train.data, cfg.run_dir)
    token_file = cache_path(source, tokenizer, cfg.run_dir / "cache")
    if env.is_local_main and not token_file.exists():
        tokenize_to_file(source, tokenizer, token_file, lambda m: print(f"trainer: {m}", flush=True))
    dist.barrier()
    return PackedTokens(token_file, len(tokenizer), cfg.train.seq_len)


@dataclass
class Batching:
    """The batch geometry DeepSpeed runs with (ds_config is the authority)."""

    micro_batch: int
    grad_accum: int
    world_size: int
    seq_len: int

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.world_size

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len


@dataclass
class RunStats:
    """Rank 0's running totals for summary.json."""

    first_loss: float | None = None
    final_loss: float | None = None
    timed_tokens: int = 0  # tokens of the steps after this process's first (warm-up) step
    timed_seconds: float = 0.0
    peak_mem_gb: list[float] | None = None


def train_step(engine, data: PackedTokens, sampler: Sampler, pos: Position, geo: Batching,
               env: DistEnv) -> torch.Tensor:
    """One optimizer step over the global batch at pos; returns this rank's summed micro losses."""
    batch = sampler.global_batch(pos.samples_seen, geo.global_batch)
    loss_sum = torch.zeros((), device=engine.device)
    for micro in range(geo.grad_accum):
        inputs, targets = data.batch(micro_slice(batch, env.rank, micro, env.world_size, geo.micro_batch))
        inputs, targets = inputs.to(engine.device), targets.to(engine.device)
        logits = engine(input_ids=inputs).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))
        engine.backward(loss)  # DeepSpeed scales by 1/grad_accum
        engine.step()  # applies the update only at the accumulation boundary
        loss_sum += loss.detach()
    return loss_sum


def gather_stats(loss_sum: torch.Tensor, geo: Batching) -> tuple[float, list[float] | None]:
    """Mean loss over the whole global batch, and each rank's peak GPU memory (GB)."""
    on_gpu = loss_sum.device.type == "cuda"
    mem = torch.cuda.max_memory_allocated() / 2**30 if on_gpu else -1.0
    mine = torch.stack([loss_sum.float(), torch.tensor(mem, device=loss_sum.device)])
    every = [torch.zeros_like(mine) for _ in range(geo.world_size)]
    dist.all_gather(every, mine)
    loss = sum(t[0].item() for t in every) / (geo.world_size * geo.grad_accum)
    return loss, ([round(t[1].item(), 3) for t in every] if on_gpu else None)


def train(cfg: RunConfig, env: DistEnv) -> dict:
    say = lambda m: log0(env, m)  # noqa: E731
    for warning in cfg.warnings:
        say(f"warning: {warning}")
    ds_config = json.loads((cfg.run_dir / cfg.ds_config).read_text())
    precision = ds_precision(ds_config)
    if precision != cfg.train.precision:
        say(f"warning: run.json precision {cfg.train.precision} but ds_config runs {precision}; using {precision}")
    deepspeed.init_distributed(dist_backend=dist_backend())

    tokenizer = load_tokenizer(cfg.train)
    data = load_data(cfg, env, tokenizer)
    model = build_model(cfg.train, precision, tokenizer)
    params = count_params(model)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      config=str(cfg.run_dir / cfg.ds_config))
    geo = Batching(engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps(),
                   env.world_size, cfg.train.seq_len)
    if (geo.micro_batch, geo.grad_accum) != (cfg.train.micro_batch, cfg.train.grad_accum):
        say(f"warning: ds_config runs micro_batch {geo.micro_batch} x grad_accum {geo.grad_accum}, "
            f"run.json says {cfg.train.micro_batch} x {cfg.train.grad_accum}; following ds_config")
    say(f"model {cfg.train.model}: {params / 1e6:.2f}M params, {precision}, vocab {len(tokenizer)}; "
        f"data {data.num_samples} samples of {cfg.train.seq_len} tokens; world {env.world_size}, "
        f"global batch {geo.global_batch} ({geo.tokens_per_step} tokens/step)")

    store = open_store(cfg, say if env.is_main else (lambda m: None))
    pos = resume(engine, cfg, env, store, say)
    sampler = Sampler(data.num_samples, cfg.train.seed)
    ckpt = Checkpointer(engine, cfg, env, store, say)
    metrics = MetricsLog(cfg.run_dir, cfg.train.max_steps) if env.is_main else None
    device_name = get_accelerator().device_name()
    peak = peak_tflops(torch.cuda.get_device_name() if device_name == "cuda" else None)
    stats, start_step = RunStats(), pos.step

    engine.train()
    while pos.step < cfg.train.max_steps:
        lr = engine.get_lr()[0]
        started = time.perf_counter()
        loss_sum = train_step(engine, data, sampler, pos, geo, env)
        pos = Position(pos.step + 1, pos.samples_seen + geo.global_batch)
        log_now = pos.step % cfg.train.log_every == 0 or pos.step in (start_step + 1, cfg.train.max_steps)
        loss, mem = gather_stats(loss_sum, geo) if log_now else (None, None)
        if device_name == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        if pos.step > start_step + 1:
            stats.timed_tokens += geo.tokens_per_step
            stats.timed_seconds += seconds
        if log_now and metrics is not None:
            rate = throughput(geo.tokens_per_step, seconds, params, env.world_size, peak)
            record = StepRecord(step=pos.step, loss=loss, lr=lr, tokens=pos.samples_seen * geo.seq_len,
                                tokens_per_s=round(rate.tokens_per_s, 1), step_time_s=round(seconds, 4),
                                tflops_per_gpu=round(rate.tflops_per_gpu, 4), mfu=rate.mfu, peak_mem_gb=mem,
                                skipped=precision == "fp16" and not engine.was_step_applied())
            metrics.write(record)
            stats.first_loss = loss if stats.first_loss is None else stats.first_loss
            stats.final_loss, stats.peak_mem_gb = loss, mem
        every = cfg.train.checkpoint_every
        if (every and pos.step % every == 0) or pos.step == cfg.train.max_steps:
            ckpt.save(pos, geo.global_batch)
    ckpt.finish()
    return summarize(stats, pos, start_step, geo, params, peak, ckpt.last_tag, cfg)


def summarize(stats: RunStats, pos: Position, start_step: int, geo: Batching, params: int,
              peak: float | None, last_tag: str | None, cfg: RunConfig) -> dict:
    rate = throughput(stats.timed_tokens, stats.timed_seconds, params, geo.world_size, peak)
    return {"state": "succeeded", "run_id": cfg.run_id, "steps": pos.step, "start_step": start_step,
            "first_loss": stats.first_loss, "final_loss": stats.final_loss,
            "tokens_per_s": round(rate.tokens_per_s, 1), "tflops_per_gpu": round(rate.tflops_per_gpu, 4),
            "mfu": rate.mfu, "peak_mem_gb": stats.peak_mem_gb, "world_size": geo.world_size,
            "global_batch": geo.global_batch, "seq_len": geo.seq_len, "params": params,
            "last_checkpoint": last_tag}


def write_final(cfg: RunConfig, env: DistEnv, summary: dict) -> None:
    if env.is_main:
        write_summary(cfg.run_dir, summary)
        print(f"trainer: done: {summary['steps']} steps, loss {summary['first_loss']} -> "
              f"{summary['final_loss']}, {summary['tokens_per_s']} tok/s", flush=True)
