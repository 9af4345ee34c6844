"""The training loop: set up, then steps of grad_accum micro-steps, logging and checkpoints.

Read it top to bottom: train() is the whole run, setup() builds the pieces, train_step() is
one optimizer step. DeepSpeed owns the optimizer, LR scheduler, precision and ZeRO (all
from ds_config); this file owns the data order, the loss and the bookkeeping.
"""

from __future__ import annotations

import json
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from deepspeed.accelerator import get_accelerator

from trainer import events, opscache, secrets_file, stop_signal
from trainer.checkpoint import Checkpointer, Position, open_store, resume
from trainer.config import DistEnv, RunConfig
from trainer.dataset import (
    PackedTokens,
    Sampler,
    cache_path,
    micro_slice,
    prepare_token_file,
    resolve_data,
)
from trainer.distributed import leave_process_group, start_distributed
from trainer.hostenv import all_cores
from trainer.metrics import (
    MetricsLog,
    StepRecord,
    peak_tflops,
    throughput,
    write_summary,
)
from trainer.model import build_model, count_params
from trainer.pinning import exact_pinning, pin_offload, settle_pin_memory
from trainer.tokenizer import load_tokenizer

# DeepSpeed's ZeRO calls a torch API that torch 2.13 deprecates: one line per rank per run, no action.
warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.*", category=FutureWarning)


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
class Session:
    """Everything a run needs, built once by setup()."""

    cfg: RunConfig
    env: DistEnv
    engine: Any  # deepspeed.DeepSpeedEngine, or trainer.fsdp_engine.FsdpEngine (train.strategy fsdp)
    data: PackedTokens
    geo: Batching
    params: int
    precision: str
    peak_tflops: float | None  # None on CPU / unknown GPUs: no MFU

    def say(self, message: str) -> None:
        if self.env.is_main:
            print(f"trainer: {message}", flush=True)


@dataclass
class StepParts:
    """Where one optimizer step's seconds went, as this rank timed them (the parts plan models):
    forward + backward of every micro-step (with ZeRO-2 the gradient reduction and the offloaded
    gradients' copy run in backward's hooks), and engine.step() (the CPU optimizer, the updated
    parameters' copy back and their all-gather)."""

    fwd_bwd_s: float = 0.0
    optimizer_s: float = 0.0


@dataclass
class RunStats:
    """Rank 0's running totals for summary.json."""

    start_step: int = 0  # the step this process started from (0, or the resumed step)
    first_loss: float | None = None
    final_loss: float | None = None
    timed_tokens: int = 0  # tokens of the steps after this process's first (warm-up) step
    timed_seconds: float = 0.0
    all_tokens: int = 0  # every step, for runs of a single step
    all_seconds: float = 0.0
    peak_mem_gb: list[float] | None = None
    parts: StepParts | None = None  # the last step's forward/backward and optimizer seconds
    pending_save_s: float = 0.0  # saves since the last logged record (metrics.jsonl's save_s)
    saves: list[float] = field(default_factory=list)  # every save's seconds (summary.json)

    def add_step(self, tokens: int, seconds: float, warmup: bool) -> None:
        self.all_tokens, self.all_seconds = self.all_tokens + tokens, self.all_seconds + seconds
        if not warmup:
            self.timed_tokens, self.timed_seconds = self.timed_tokens + tokens, self.timed_seconds + seconds

    def tokens_and_seconds(self) -> tuple[int, float]:
        return (self.timed_tokens, self.timed_seconds) if self.timed_seconds else (self.all_tokens, self.all_seconds)


def train(cfg: RunConfig, env: DistEnv, stop: stop_signal.StopSignal) -> dict:
    """The whole run on this rank; returns summary.json's content. Ends early, saved, on `stop`'s signal."""
    run = setup(cfg, env)
    secrets_file.drop(cfg.run_dir, env)  # every rank is past load_data's barrier: every rank has read it
    store = open_store(cfg, run.say)
    pos = resume(run.engine, cfg, env, store, run.say)
    sampler = Sampler(run.data.num_samples, cfg.train.seed)
    ckpt = Checkpointer(run.engine, cfg, env, store, run.say, params=run.params, precision=run.precision)
    metrics = MetricsLog(cfg.run_dir, cfg.train.max_steps) if env.is_main else None
    stats = RunStats(start_step=pos.step)

    events.phase("first step", f"step {pos.step + 1} of {cfg.train.max_steps}")
    run.engine.train()
    while pos.step < cfg.train.max_steps and not stop.stopped:
        pos = step_and_log(run, sampler, pos, stats, metrics)
        if stop.agreed() or checkpoint_due(cfg, pos.step):  # agreed() first: a collective on every rank
            started = time.perf_counter()
            ckpt.save(pos, run.geo.global_batch, final=pos.step == cfg.train.max_steps or stop.stopped)
            stats.saves.append(time.perf_counter() - started)
            stats.pending_save_s += stats.saves[-1]
    summary = stop.note(summarize(run, stats, pos, ckpt.last_tag), run.say)
    leave_process_group()  # every rank at once: no rank waits inside a collective while uploads finish
    ckpt.finish()  # local rank 0 of each node: this node's last uploads, outside any collective
    return summary


def step_and_log(
    run: Session, sampler: Sampler, pos: Position, stats: RunStats, metrics: MetricsLog | None
) -> Position:
    """One optimizer step and its bookkeeping (the unit that tokens/s measures); returns the new position."""
    train = run.cfg.train
    lr = run.engine.get_lr()[0]
    started = time.perf_counter()
    stats.parts = StepParts()
    loss_sum = train_step(run, sampler, pos, stats.parts)
    pos = Position(pos.step + 1, pos.samples_seen + run.geo.global_batch)
    log_now = pos.step % train.log_every == 0 or pos.step in (stats.start_step + 1, train.max_steps)
    loss, mem = gather_stats(loss_sum, run.geo) if log_now else (None, None)
    if loss_sum.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    stats.add_step(run.geo.tokens_per_step, seconds, warmup=pos.step == stats.start_step + 1)
    if metrics is not None and log_now:
        record_step(run, metrics, stats, pos, lr, loss, mem, seconds)
    return pos


def setup(cfg: RunConfig, env: DistEnv) -> Session:
    ds_config = json.loads((cfg.run_dir / cfg.ds_config).read_text())
    precision = ds_precision(ds_config)
    events.start(cfg.run_dir, env.is_main)
    opscache.for_run(open_store(cfg, print), ds_config, lambda m: print(f"trainer: {m}", flush=True))  # see there
    events.compile_phase("starting ranks", events.ops_needed(ds_config, at_init=False))
    fsdp_offload = cfg.train.strategy == "fsdp" and cfg.train.offload_optimizer == "cpu"
    start_distributed(env, precision, cfg.collective_timeout_s, cpu_offload=fsdp_offload)
    say = (lambda m: print(f"trainer: {m}", flush=True)) if env.is_main else (lambda _m: None)
    for warning in cfg.warnings:
        say(f"warning: {warning}")
    pin = pin_offload(get_accelerator().device_name(), exact_pinning())  # both strategies (trainer.pinning)
    if get_accelerator().device_name() != "cpu" and settle_pin_memory(ds_config, pin):
        say(
            f"torch {torch.__version__} rounds every pinned block up to a power of two: offload buffers stay "
            "pageable (exact-size pinning needs torch >= 2.13)"
        )
    if precision != cfg.train.precision:
        say(f"warning: run.json precision {cfg.train.precision} but ds_config runs {precision}; using {precision}")
    tensorboard_or_off(ds_config, say)
    if not env.is_main:  # one "Loading weights" bar in job.log, not one per rank
        transformers.utils.logging.disable_progress_bar()
    events.phase("tokenizing data", str(cfg.train.data))
    tokenizer = load_tokenizer(cfg.train)
    data = load_data(cfg, env, tokenizer)
    events.phase(*events.model_phase(str(cfg.train.model)))
    fsdp = cfg.train.strategy == "fsdp"
    model = build_model(cfg.train, "fp32" if fsdp else precision, tokenizer)  # FSDP: fp32 masters, bf16 compute
    params = count_params(model)
    if fsdp:  # PyTorch FSDP2 behind the same engine interface (trainer/fsdp_engine.py)
        from trainer.fsdp_engine import FsdpEngine

        engine: Any = FsdpEngine(model, ds_config, cfg.train, env, precision, pin_memory=pin)
        if engine.offloaded:
            say(f"fsdp: CPU offload ({'pinned' if engine.pinned else 'pageable'}), process group {dist.get_backend()}")
    else:
        events.compile_phase("initializing DeepSpeed", events.ops_needed(ds_config, at_init=True))
        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=ds_config
        )
    geo = Batching(
        engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps(), env.world_size, cfg.train.seq_len
    )
    if (geo.micro_batch, geo.grad_accum) != (cfg.train.micro_batch, cfg.train.grad_accum):
        say(
            f"warning: ds_config runs micro_batch {geo.micro_batch} x grad_accum {geo.grad_accum}, "
            f"run.json says {cfg.train.micro_batch} x {cfg.train.grad_accum}; following ds_config"
        )
    gpu_name = torch.cuda.get_device_name() if get_accelerator().device_name() == "cuda" else None
    say(
        f"model {cfg.train.model} ({cfg.train.strategy}): {params / 1e6:.2f}M params, {precision}, vocab {len(tokenizer)}; "
        f"data {data.num_samples} samples of {cfg.train.seq_len} tokens; world {env.world_size}, "
        f"global batch {geo.global_batch} ({geo.tokens_per_step} tokens/step)" + (f"; {gpu_name}" if gpu_name else "")
    )
    return Session(cfg, env, engine, data, geo, params, precision, peak_tflops(gpu_name))


def tensorboard_or_off(ds_config: dict, say) -> None:
    """DeepSpeed's TensorBoard monitor needs the `tensorboard` package (optional): without it,
    one warning and the run goes on with the monitor off (DeepSpeed would raise ImportError)."""
    block = ds_config.get("tensorboard")
    if not isinstance(block, dict) or not block.get("enabled"):
        return
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        say(
            "warning: train.tensorboard is on but the tensorboard package is not installed on the node "
            "(pip install tensorboard); going on without TensorBoard logs"
        )
        block["enabled"] = False


def ds_precision(ds_config: dict) -> str:
    if ds_config.get("bf16", {}).get("enabled"):
        return "bf16"
    if ds_config.get("fp16", {}).get("enabled"):
        return "fp16"
    return "fp32"


def load_data(cfg: RunConfig, env: DistEnv, tokenizer) -> PackedTokens:
    """The run dir's main rank (env.is_dir_main) fetches and tokenizes once into a token file; every rank maps it."""
    source = resolve_data(cfg.train.data, cfg.run_dir)  # every rank: the same one-line error for a bad path/url
    if env.is_dir_main:
        with all_cores():  # the other ranks wait: tokenize on every core, not this rank's share
            prepare_token_file(
                cfg.train.data, cfg.run_dir, cfg.storage, tokenizer, lambda m: print(f"trainer: {m}", flush=True)
            )
    dist.barrier()
    token_file = cache_path(source, tokenizer, cfg.run_dir / "cache")
    return PackedTokens(token_file, len(tokenizer), cfg.train.seq_len)


def train_step(run: Session, sampler: Sampler, pos: Position, parts: StepParts | None = None) -> torch.Tensor:
    """One optimizer step over the global batch at pos; returns this rank's summed micro losses.
    With `parts`, adds the seconds of forward + backward and of engine.step() to it (on CUDA each
    part ends with a synchronize, so a part's kernels are charged to it)."""
    engine, geo, env = run.engine, run.geo, run.env
    batch = sampler.global_batch(pos.samples_seen, geo.global_batch)
    loss_sum = torch.zeros((), device=engine.device)
    sync = torch.cuda.synchronize if engine.device.type == "cuda" and parts is not None else (lambda: None)
    for micro in range(geo.grad_accum):
        started = time.perf_counter()
        inputs, targets = run.data.batch(micro_slice(batch, env.rank, micro, env.world_size, geo.micro_batch))
        inputs, targets = inputs.to(engine.device), targets.to(engine.device)
        logits = engine(input_ids=inputs).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))
        engine.backward(loss)  # DeepSpeed scales by 1/grad_accum
        sync()
        stepped = time.perf_counter()
        engine.step()  # applies the update only at the accumulation boundary
        sync()
        if parts is not None:
            parts.fwd_bwd_s += stepped - started
            parts.optimizer_s += time.perf_counter() - stepped
        loss_sum += loss.detach()
        del logits, loss  # free the logits (seq x vocab) before the next micro-step's forward
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


def record_step(
    run: Session,
    metrics: MetricsLog,
    stats: RunStats,
    pos: Position,
    lr: float,
    loss: float,
    mem: list[float] | None,
    seconds: float,
) -> None:
    rate = throughput(run.geo.tokens_per_step, seconds, run.params, run.env.world_size, run.peak_tflops)
    metrics.write(
        StepRecord(
            step=pos.step,
            loss=loss,
            lr=lr,
            tokens=pos.samples_seen * run.geo.seq_len,
            tokens_per_s=round(rate.tokens_per_s, 1),
            step_time_s=round(seconds, 4),
            tflops_per_gpu=round(rate.tflops_per_gpu, 4),
            mfu=rate.mfu,
            peak_mem_gb=mem,
            skipped=run.precision == "fp16" and not run.engine.was_step_applied(),
            loss_scale=loss_scale(run),
            skipped_steps=skipped_steps(run),
            fwd_bwd_s=round(stats.parts.fwd_bwd_s, 4) if stats.parts else None,
            optimizer_s=round(stats.parts.optimizer_s, 4) if stats.parts else None,
            save_s=round(stats.pending_save_s, 4) if stats.pending_save_s else None,
        )
    )
    stats.pending_save_s = 0.0
    monitor = getattr(run.engine, "monitor", None)
    if monitor is not None and monitor.enabled:  # DeepSpeed's monitors (TensorBoard): rank 0 writes
        monitor.write_events(
            [
                ("gpuctl/loss", loss, pos.step),
                ("gpuctl/lr", lr, pos.step),
                ("gpuctl/tokens_per_s", rate.tokens_per_s, pos.step),
            ]
        )
    stats.first_loss = loss if stats.first_loss is None else stats.first_loss
    stats.final_loss, stats.peak_mem_gb = loss, mem


def loss_scale(run: Session) -> float | None:
    """fp16's dynamic loss scale now (None for bf16/fp32: no scaling)."""
    scale = getattr(run.engine.optimizer, "loss_scale", None) if run.precision == "fp16" else None
    return float(scale) if scale is not None else None


def skipped_steps(run: Session) -> int:
    """Optimizer steps DeepSpeed skipped on fp16 overflow so far (kept across resume in its checkpoint)."""
    return int(getattr(run.engine, "skipped_steps", 0) or 0)


def checkpoint_due(cfg: RunConfig, step: int) -> bool:
    every = cfg.train.checkpoint_every
    return (every > 0 and step % every == 0) or step == cfg.train.max_steps


def summarize(run: Session, stats: RunStats, pos: Position, last_tag: str | None) -> dict:
    tokens, seconds = stats.tokens_and_seconds()
    rate = throughput(tokens, seconds, run.params, run.env.world_size, run.peak_tflops)
    return {
        "state": "succeeded",
        "run_id": run.cfg.run_id,
        "strategy": run.cfg.train.strategy,
        "steps": pos.step,
        "start_step": stats.start_step,
        "first_loss": stats.first_loss,
        "final_loss": stats.final_loss,
        "tokens_per_s": round(rate.tokens_per_s, 1),
        "tflops_per_gpu": round(rate.tflops_per_gpu, 4),
        "mfu": rate.mfu,
        "peak_mem_gb": stats.peak_mem_gb,
        "world_size": run.env.world_size,
        "global_batch": run.geo.global_batch,
        "seq_len": run.geo.seq_len,
        "params": run.params,
        "precision": run.precision,
        "loss_scale": loss_scale(run),
        "skipped_steps": skipped_steps(run),
        "last_checkpoint": last_tag,
        "save_s": [round(s, 3) for s in stats.saves],  # each checkpoint save, seconds on rank 0
        **events.summary_fields(),  # the phases before the first step: seconds, and how ops went
    }


def finish(cfg: RunConfig, env: DistEnv, summary: dict) -> None:
    """Rank 0 writes summary.json (after the final upload sync); then leave the process group."""
    if env.is_main:
        write_summary(cfg.run_dir, summary)
        losses = " -> ".join(f"{v:.4f}" for v in (summary["first_loss"], summary["final_loss"]) if v is not None)
        print(
            f"trainer: done: step {summary['steps']}, loss {losses or 'n/a'}, {summary['tokens_per_s']} tok/s",
            flush=True,
        )
    if dist.is_initialized():
        dist.destroy_process_group()
