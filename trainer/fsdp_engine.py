"""PyTorch FSDP2 (torch.distributed.fsdp.fully_shard) behind the DeepSpeed engine's interface.

train.strategy fsdp: the loop and the checkpointer call the same methods they call on DeepSpeed's
engine (forward, backward, step at the accumulation boundary, get_lr, save_checkpoint,
load_checkpoint), so trainer/loop.py stays one loop for both strategies.

What comes from where (the same rendered ds_config.json, so the batch arithmetic is one):
- micro batch, grad accumulation, gradient clipping, AdamW's lr/betas/eps/weight decay and the
  WarmupDecayLR schedule: ds_config.json; its ZeRO block is DeepSpeed's and ignored here.
- sharding: fully_shard on every decoder layer, then the root (parameters, gradients and optimizer
  state all sharded across the ranks: ZeRO-3's layout); gradients reduce-scatter every micro-step.
- precision: fp32 master weights; bf16 runs as MixedPrecisionPolicy(param bf16, reduce fp32).
  fp16 is refused by the config (it needs a loss scaler): no loss scale, no skipped steps.
- offload_optimizer cpu: CPUOffloadPolicy (sharded parameters, gradients and the optimizer step on
  the host), pinned only where DeepSpeed's buffers would be (trainer.pinning.pin_offload: exact-size pinning,
  torch >= 2.13; torch's default rounds each pinned block to a power of two). CPU ranks run the same
  policy unpinned (pinning needs an accelerator), so the offload path (CPU DTensor gradients clipped
  through the process group's `cpu:gloo`, trainer.distributed.group_backend) runs here as on GPUs.
- activation checkpointing: trainer.model turns on the model's own gradient checkpointing.
- checkpoints: torch.distributed.checkpoint (DCP), one file set per rank plus `.metadata`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from trainer.config import DistEnv, TrainConfig, TrainerError
from trainer.fsdp_export import DCP_METADATA

ENGINE_FILE = "fsdp_engine.json"  # next to the DCP shards: the LR schedule's position


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks each get their own FSDP unit (Llama/DeepSeek: model.model.layers)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise TrainerError(f"strategy fsdp: cannot find the decoder layers of {type(model).__name__} (model.layers)")
    return list(layers)


def lr_lambda(warmup: int, total: int):
    """DeepSpeed's WarmupDecayLR (linear warm-up to the peak, linear decay to 0 at total) as a factor."""

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return step / warmup
        return max(0.0, (total - step) / max(1, total - warmup)) if warmup else 1.0

    return factor


class FsdpEngine:
    """One rank's FSDP2-sharded model and its optimizer, driven like a DeepSpeedEngine."""

    def __init__(
        self,
        model: torch.nn.Module,
        ds_config: dict,
        train: TrainConfig,
        env: DistEnv,
        precision: str,
        pin_memory: bool = False,
    ):
        self.env = env
        on_gpu = torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        self.micro_batch = int(ds_config["train_micro_batch_size_per_gpu"])
        self.grad_accum = int(ds_config["gradient_accumulation_steps"])
        self.clip = float(ds_config.get("gradient_clipping", 0.0) or 0.0)
        self.offloaded = train.offload_optimizer == "cpu"
        self.pinned = self.offloaded and on_gpu and pin_memory  # trainer.pinning.pin_offload, as for DeepSpeed
        mesh = init_device_mesh(self.device.type, (env.world_size,))
        options: dict[str, Any] = {"mesh": mesh}
        if precision == "bf16":
            options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if self.offloaded:
            options["offload_policy"] = CPUOffloadPolicy(pin_memory=self.pinned)
        elif not on_gpu:
            model.to(self.device)
        for layer in decoder_layers(model):
            fully_shard(layer, **options)
        fully_shard(model, **options)
        self.module = model
        self.optimizer = self._adamw(ds_config)
        sched = ds_config.get("scheduler") or {}
        params = sched.get("params", {})
        warmup = int(params.get("warmup_num_steps", 0)) if sched.get("type") == "WarmupDecayLR" else 0
        total = int(params.get("total_num_steps", 0))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(warmup, total))
        self.micro_steps = 0
        self.skipped_steps = 0  # no loss scaling: no step is ever skipped

    def _adamw(self, ds_config: dict) -> torch.optim.Optimizer:
        opt = ds_config.get("optimizer", {})
        if opt.get("type", "AdamW").lower() not in ("adamw", "adam"):
            raise TrainerError(f"strategy fsdp runs AdamW; ds_config asks for optimizer {opt.get('type')!r}")
        p = opt.get("params", {})
        return torch.optim.AdamW(
            self.module.parameters(),
            lr=float(p.get("lr", 1e-3)),
            betas=tuple(p.get("betas", (0.9, 0.999))),
            eps=float(p.get("eps", 1e-8)),
            weight_decay=float(p.get("weight_decay", 0.0)),
        )

    # -- the DeepSpeedEngine surface the loop uses ------------------------------------------
    def __call__(self, **inputs):
        return self.module(**inputs)

    def train(self) -> None:
        self.module.train()

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.micro_batch

    def gradient_accumulation_steps(self) -> int:
        return self.grad_accum

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def was_step_applied(self) -> bool:
        return True

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self.grad_accum).backward()  # as DeepSpeed: the mean over the accumulated micro-steps

    def step(self) -> None:
        """Every micro-step; the update (clip, AdamW, schedule) only at the accumulation boundary."""
        self.micro_steps += 1
        if self.micro_steps % self.grad_accum:
            return
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()

    # -- checkpoints (torch.distributed.checkpoint) ------------------------------------------
    def save_checkpoint(self, save_dir: str, tag: str, client_state: dict | None = None) -> None:
        """Collective: every rank writes its shards of model + optimizer into save_dir/tag (DCP)."""
        model_sd, optim_sd = get_state_dict(self.module, self.optimizer)
        target = Path(save_dir) / tag
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(target))
        if self.env.is_dir_main:  # every node's run dir: resume reads it from its own copy
            extra = {"scheduler": self.scheduler.state_dict(), "micro_steps": self.micro_steps}
            (target / ENGINE_FILE).write_text(json.dumps(extra) + "\n")

    def load_checkpoint(self, load_dir: str, tag: str) -> tuple[str | None, dict]:
        """Collective: load this rank's shards back; returns (path, the trainer state saved beside it)."""
        from trainer.checkpoint import STATE_FILE

        source = Path(load_dir) / tag
        if not (source / DCP_METADATA).is_file():
            raise TrainerError(f"{source} is not an FSDP (torch.distributed.checkpoint) checkpoint: no {DCP_METADATA}")
        model_sd, optim_sd = get_state_dict(self.module, self.optimizer)  # initialises AdamW's state to load into
        state = {"model": model_sd, "optim": optim_sd}
        from torch.utils.serialization import config

        mmap, config.load.mmap = config.load.mmap, False  # DCP reads from streams; trainer.checkpoint maps DS files
        try:
            dcp.load(state, checkpoint_id=str(source))
        finally:
            config.load.mmap = mmap
        set_state_dict(self.module, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        extra = json.loads((source / ENGINE_FILE).read_text())
        self.scheduler.load_state_dict(extra["scheduler"])
        self.micro_steps = int(extra["micro_steps"])
        return str(source), json.loads((source / STATE_FILE).read_text())
