"""run.json -> typed config (docs/CONTRACTS.md). Light: no torch import here.

Every field has a comment saying what it means; `load_run_config` validates and raises
TrainerError with one readable line when something is wrong.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path


class TrainerError(Exception):
    """An error with a one-line, user-facing message (no traceback needed).

    everywhere=True means every rank raises the same error (bad config, world-size mismatch),
    so only rank 0 prints it; False means it is rank-specific and every rank prints its own.
    """

    def __init__(self, message: str, everywhere: bool = True):
        super().__init__(message)
        self.everywhere = everywhere


PRECISIONS = ("fp32", "fp16", "bf16")
STRATEGIES = ("deepspeed", "fsdp")
# The process group's timeout when run.json has none: 30 min (DeepSpeed's default, 10 min, is shorter than
# a rank waiting for local rank 0 to download a 7B checkpoint or tokenize a large dataset).
DEFAULT_COLLECTIVE_TIMEOUT_S = 1800
TIMEOUT_ENV = "GPUCTL_COLLECTIVE_TIMEOUT_S"  # on the node (gpuctl.yaml env), overrides run.json
# Set by a batch scheduler's restart of the same run (provider slurm's requeue: slurm.sh): resume from the
# newest complete checkpoint this run saved before it was stopped.
REQUEUED_ENV = "GPUCTL_REQUEUED"


@dataclass(frozen=True)
class TrainConfig:
    """The `train` block of run.json."""

    strategy: str = "deepspeed"  # deepspeed (ZeRO, ds_config) | fsdp (PyTorch FSDP2, trainer/fsdp_engine.py)
    model: str = "tiny"  # 'tiny' (built here, DeepSeek-shaped), an HF model id, or a local path
    tokenizer: str | None = None  # HF id or path; default: the model's own (tiny: built-in bytes)
    data: str = "sample"  # 'sample' (shipped in trainer/data) or a .txt/.jsonl/.parquet path
    seq_len: int = 128  # tokens per sample (each packed block holds seq_len + 1)
    micro_batch: int = 1  # samples per rank per micro-step (must match ds_config)
    grad_accum: int = 4  # micro-steps per optimizer step (must match ds_config)
    precision: str = "fp32"  # fp32 | fp16 | bf16; the ds_config decides, this sets the load dtype
    zero_stage: int = 2  # informational; ds_config decides
    offload_optimizer: str = "cpu"  # informational; ds_config decides
    lr: float = 1e-3  # informational; the optimizer in ds_config decides
    warmup_steps: int = 0  # informational; the scheduler in ds_config decides
    weight_decay: float = 0.0  # informational
    grad_clip: float = 1.0  # informational
    max_steps: int = 30  # optimizer steps to train (a resumed run continues up to this)
    checkpoint_every: int = 10  # save every N steps (0 = only at the end)
    keep_local: int = 2  # newest checkpoint tags kept on the node's disk (once uploaded)
    seed: int = 1234  # model init and data order
    gradient_checkpointing: bool = False  # recompute activations in backward to save memory
    log_every: int = 1  # log (job.log + metrics.jsonl) every N steps, and the last step
    tensorboard: bool = False  # informational; ds_config's "tensorboard" block decides

    def validate(self) -> None:
        positive = ("seq_len", "micro_batch", "grad_accum", "max_steps", "keep_local", "log_every")
        for name in positive:
            if getattr(self, name) < 1:
                raise TrainerError(f"run.json: train.{name} must be >= 1, got {getattr(self, name)}")
        if self.checkpoint_every < 0:
            raise TrainerError(f"run.json: train.checkpoint_every must be >= 0, got {self.checkpoint_every}")
        if self.strategy not in STRATEGIES:
            raise TrainerError(f"run.json: train.strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if self.precision not in PRECISIONS:
            raise TrainerError(f"run.json: train.precision must be one of {PRECISIONS}, got {self.precision!r}")


@dataclass(frozen=True)
class RunConfig:
    """The whole run.json."""

    run_id: str  # e.g. 20261202-111500-ab12
    ds_config: Path  # DeepSpeed config path (relative to the run dir)
    num_nodes: int  # nodes in this run (node rank = RANK // local world size)
    train: TrainConfig
    storage: dict | None = None  # object storage settings for trainer.objstore; None = no upload
    resume: str | None = None  # None, 'latest', a tag 'stepN', or an absolute local save dir
    run_dir: Path = field(default_factory=Path.cwd)  # where outputs go (the cwd)
    warnings: tuple[str, ...] = ()  # unknown keys etc., printed by rank 0
    # seconds a collective may wait before the ranks give up (gpuctl derives it from plan's sizes)
    collective_timeout_s: int = DEFAULT_COLLECTIVE_TIMEOUT_S
    shared_dir: bool = False  # every node's ranks see this one run dir (a Slurm job's shared filesystem)


def _typed(cls, block: dict, where: str) -> tuple[dict, list[str]]:
    """Keep the known fields of a dataclass, check their basic types, report unknown keys."""
    known = {f.name: f for f in dataclasses.fields(cls)}
    values, unknown = {}, []
    for key, value in block.items():
        if key not in known:
            unknown.append(f"{where}.{key}")
            continue
        default = known[key].default
        if isinstance(default, bool) and not isinstance(value, bool):
            raise TrainerError(f"run.json: {where}.{key} must be true or false, got {value!r}")
        if (
            isinstance(default, int)
            and not isinstance(default, bool)
            and (isinstance(value, bool) or not isinstance(value, int))
        ):
            raise TrainerError(f"run.json: {where}.{key} must be an integer, got {value!r}")
        if isinstance(default, float) and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise TrainerError(f"run.json: {where}.{key} must be a number, got {value!r}")
        values[key] = float(value) if isinstance(default, float) else value
    return values, unknown


def parse_run_config(raw: dict, run_dir: Path) -> RunConfig:
    """Validate a parsed run.json. Paths stay relative to run_dir (the cwd of every rank)."""
    for key in ("ds_config", "train"):
        if key not in raw:
            raise TrainerError(f"run.json: missing required key {key!r}")
    if not isinstance(raw["train"], dict):
        raise TrainerError("run.json: train must be an object")
    train_values, unknown = _typed(TrainConfig, raw["train"], "train")
    train = TrainConfig(**train_values)
    train.validate()
    resume = raw.get("resume")
    if resume is not None and (not isinstance(resume, str) or not resume):
        raise TrainerError(f"run.json: resume must be null, 'latest', a tag or an absolute path, got {resume!r}")
    storage = raw.get("storage")
    if storage is not None and not isinstance(storage, dict):
        raise TrainerError("run.json: storage must be an object or null")
    if os.environ.get(REQUEUED_ENV):
        resume = requeued_resume(run_dir, storage, resume)
    known = ("run_id", "ds_config", "num_nodes", "train", "storage", "resume", "collective_timeout_s", "shared_dir")
    unknown += [k for k in raw if k not in known]
    num_nodes = raw.get("num_nodes", 1)
    if not isinstance(num_nodes, int) or num_nodes < 1:
        raise TrainerError(f"run.json: num_nodes must be an integer >= 1, got {num_nodes!r}")
    shared_dir = raw.get("shared_dir", False)
    if not isinstance(shared_dir, bool):
        raise TrainerError(f"run.json: shared_dir must be true or false, got {shared_dir!r}")
    timeout = _timeout(raw.get("collective_timeout_s", DEFAULT_COLLECTIVE_TIMEOUT_S), "run.json: collective_timeout_s")
    if os.environ.get(TIMEOUT_ENV):
        timeout = _timeout(os.environ[TIMEOUT_ENV], TIMEOUT_ENV)
    return RunConfig(
        collective_timeout_s=timeout,
        run_id=str(raw.get("run_id", "local")),
        ds_config=Path(raw["ds_config"]),
        num_nodes=num_nodes,
        shared_dir=shared_dir,
        train=train,
        storage=storage,
        resume=resume,
        run_dir=run_dir,
        warnings=tuple(f"run.json: ignoring unknown key {k}" for k in unknown),
    )


def requeued_resume(run_dir: Path, storage: dict | None, resume: str | None) -> str | None:
    """Where a restarted run continues: its newest complete checkpoint. With a store, the newest tag this
    run saved (checkpoints/ on the shared filesystem): the store's copy if complete, else its newest complete
    one before it (retention.download), never a later run's. Without one, DeepSpeed's save dir in the run
    dir. Nothing saved yet by this run: what the run started from."""
    ckpt = run_dir / "checkpoints"
    steps = [int(p.name[4:]) for p in ckpt.glob("step*") if p.is_dir() and p.name[4:].isdigit()]
    if not steps:
        return resume
    if storage is not None:
        return f"step{max(steps)}"
    return str(ckpt.resolve()) if (ckpt / "latest").is_file() else resume


def _timeout(value: object, where: str) -> int:
    try:
        seconds = int(str(value)) if not isinstance(value, bool) else 0
    except ValueError:
        seconds = 0
    if seconds < 1:
        raise TrainerError(f"{where} must be a whole number of seconds >= 1, got {value!r}")
    return seconds


def load_run_config(path: Path) -> RunConfig:
    try:
        raw = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise TrainerError(f"{path}: no such file (run the trainer from the run dir)") from None
    except json.JSONDecodeError as exc:
        raise TrainerError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise TrainerError(f"{path}: expected a JSON object")
    cfg = parse_run_config(raw, Path(path).resolve().parent)
    if not (cfg.run_dir / cfg.ds_config).is_file():
        raise TrainerError(f"run.json: ds_config {cfg.ds_config} not found in {cfg.run_dir}")
    return cfg


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits, from the launcher's env (DeepSpeed launcher or torchrun)."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    shared_dir: bool = False  # RunConfig.shared_dir

    @property
    def node_rank(self) -> int:
        return self.rank // self.local_world_size

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_dir_main(self) -> bool:
        """The rank that does the run dir's work for its node (data prep, checkpoint download, upload, pruning):
        local rank 0, or rank 0 alone when every node sees the one run dir (else each node redoes it there)."""
        return self.rank == 0 if self.shared_dir else self.local_rank == 0

    @classmethod
    def from_env(cls, num_nodes: int = 1, shared_dir: bool = False) -> DistEnv:
        env = os.environ
        rank, world = int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1"))
        local_rank = int(env.get("LOCAL_RANK", "0"))
        local_world = int(env.get("LOCAL_SIZE") or env.get("LOCAL_WORLD_SIZE") or max(1, world // num_nodes))
        return cls(
            rank=rank, local_rank=local_rank, world_size=world, local_world_size=local_world, shared_dir=shared_dir
        )
