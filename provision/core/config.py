"""gpuctl.yaml -> typed, validated models. The batch arithmetic lives here.

Every model forbids unknown keys: a typo must never be silently ignored.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path, PurePosixPath
from typing import Literal
from urllib.parse import urlparse

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from provision.core.errors import ConfigError
from provision.core.provider_config import LocalProvider, Provider, SSHProvider, Strict
from provision.core.recovery import RecoveryConfig
from provision.core.strategy import Strategy, check_strategy

CONFIG_NAME = "gpuctl.yaml"
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
# secrets.env names gpuctl fills itself (storage credentials, the launcher's own variables)
RESERVED_SECRETS = {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "PATH", "HOME", "PYTHONPATH"}
MAX_STEPS = 100_000_000  # optimizer steps; a bound far past any run, so no value is absurd
RENTING = ("vast", "runpod", "aws")  # providers whose nodes are rented: they bill until deleted
# What `gpuctl init --provider vast|runpod|aws` writes as storage.url: `up` and `train` refuse it until set
# (upper case: no S3 bucket can have this name).
STORAGE_PLACEHOLDER = "s3://CHANGE-ME/gpuctl"


class UniqueKeyLoader(yaml.SafeLoader):  # type: ignore[misc]  # PyYAML ships no type information
    """yaml.SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last one
    silently: `max_hours: 1` then `max_hours: 100` would quietly raise a budget cap)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[object, object]:
        seen: dict[object, int] = {}
        for key_node, _value in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                first = seen.get(key)
                seen[key] = line
            except TypeError:  # an unhashable key; construct_mapping says so itself
                continue
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {str(key)[:80]!r} appears twice (first on line {first})", key_node.start_mark
                )
        mapping: dict[object, object] = super().construct_mapping(node, deep=deep)
        return mapping


class TrainConfig(Strict):
    """What to train and how. train_batch_size = micro_batch x grad_accum x world size."""

    strategy: Strategy = Field(
        default="deepspeed",
        description="deepspeed (ZeRO, ds_config.json) or fsdp (PyTorch FSDP2 under torchrun); see Strategies",
    )
    model: str = Field(
        default="tiny",
        description='"tiny" (a CPU-sized DeepSeek-shaped Llama), an HF model id, or a local model folder',
    )
    tokenizer: str | None = Field(
        default=None,
        description="tokenizer id or folder; null = the model's own (tiny: a byte-level one built offline)",
    )
    data: str = Field(
        default="sample",
        description='"sample" (shipped with gpuctl), a .txt / .jsonl / .parquet path relative to this file, or s3://bucket/key.jsonl',
    )
    seq_len: int = Field(default=128, ge=8, le=131072, description="tokens per packed training sequence")
    micro_batch: int = Field(default=1, ge=1, le=4096, description="sequences per rank per micro-step")
    grad_accum: int = Field(default=4, ge=1, le=4096, description="micro-steps per optimizer step")
    train_batch_size: int | None = Field(
        default=None, ge=1, le=1 << 30, description="optional check: must equal micro_batch x grad_accum x ranks"
    )
    precision: Literal["fp16", "bf16", "fp32"] = Field(
        default="fp32",
        description="fp16 is the RTX 4090 choice (DeepSpeed only); bf16 where the GPU has it; fp32 on CPU",
    )
    zero_stage: int = Field(
        default=2, ge=0, le=3, description="ZeRO stage; 2 partitions gradients and optimizer states across ranks"
    )
    offload_optimizer: Literal["none", "cpu"] = Field(
        default="cpu", description="cpu: keep the optimizer states (and the Adam step) in host RAM"
    )
    lr: float = Field(
        default=1e-3,
        gt=0,
        le=1,
        description="learning rate (AdamW): constant with warmup_steps 0, else linear warmup from 0 then "
        "linear decay to 0 at max_steps",
    )
    warmup_steps: int = Field(default=0, ge=0, le=MAX_STEPS, description="linear warmup steps (at most max_steps)")
    weight_decay: float = Field(default=0.0, ge=0, le=100, description="AdamW weight decay")
    grad_clip: float = Field(default=1.0, ge=0, le=1e6, description="gradient norm clipping; 0 disables")
    max_steps: int = Field(default=30, ge=1, le=MAX_STEPS, description="optimizer steps to train")
    checkpoint_every: int = Field(
        default=10, ge=0, le=MAX_STEPS, description="save (and sync to storage) every N steps; 0 = only at the end"
    )
    keep_local: int = Field(default=2, ge=1, le=1000, description="checkpoints kept on the node's disk once synced")
    seed: int = Field(default=1234, ge=0, le=2**32 - 1, description="model init and data order")
    gradient_checkpointing: bool = Field(
        default=False, description="recompute activations in backward: less memory, ~1/3 more compute"
    )
    log_every: int = Field(default=1, ge=1, le=MAX_STEPS, description="log a line every N steps")
    tensorboard: bool = Field(
        default=False,
        description="DeepSpeed's TensorBoard monitor -> <run dir>/tensorboard/ (needs `pip install tensorboard` on the node)",
    )

    @model_validator(mode="after")
    def _warmup_fits(self) -> TrainConfig:
        if self.warmup_steps > self.max_steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) exceeds max_steps ({self.max_steps})")
        defaults = type(self).model_fields
        changed = {key for key in self.model_fields_set if getattr(self, key) != defaults[key].default}
        check_strategy(self.strategy, self.precision, changed)
        return self


class StorageConfig(Strict):
    url: str = Field(
        default="./gpuctl-storage",
        description="where checkpoints go: a path (relative to this file), file:///abs/path, or s3://bucket/prefix",
    )
    endpoint_url: str | None = Field(default=None, description="S3-compatible endpoint (R2, MinIO, ...); null = AWS")
    region: str | None = Field(default=None, description="the store's region; default boto3's")
    profile: str | None = Field(
        default=None, description="AWS profile on the laptop; credentials come from boto3's usual chain"
    )
    keep: int = Field(default=3, ge=1, le=1000, description="newest complete checkpoints kept in the store")
    node_local: bool = Field(
        default=False,
        description="true: a path or file:// url on a rented node is fine with you (the checkpoints go with the node); else `up` and `train` refuse it",
    )

    @field_validator("url")
    @classmethod
    def _url_scheme(cls, url: str) -> str:
        scheme = urlparse(url).scheme
        if scheme not in ("", "file", "s3"):
            raise ValueError(f"url scheme {scheme!r} is not supported; use file:// or s3://")
        if scheme == "s3" and not urlparse(url).netloc:
            raise ValueError("s3 url needs a bucket: s3://bucket/prefix")
        return url


class DockerConfig(Strict):
    """How runtime docker gets the image to a node and runs the launcher in it."""

    ship: Literal["auto", "pull", "load", "build"] = Field(
        default="auto",
        description="how the image reaches the node: pull (registry; login from GPUCTL_REGISTRY_USER and GPUCTL_REGISTRY_PASSWORD), load (stream the laptop's copy over SSH), build (on the node), auto (load when the laptop has the image, else pull). A node that has it already is skipped",
    )
    shm_size: str = Field(
        default="16g",
        pattern=r"^[0-9]+[bkmgBKMG]?$",
        description="shared memory for the container (docker run --shm-size)",
    )
    ulimits: list[str] = Field(
        default=["memlock=-1", "stack=67108864"],
        description="docker run --ulimit values; memlock=-1 needs a host that lets root raise its hard limit",
    )
    mounts: list[str] = Field(
        default_factory=list, description='extra volumes, "SRC:DST[:ro]" (datasets, model caches)'
    )
    run_args: list[str] = Field(default_factory=list, description='extra `docker run` arguments, e.g. ["--cpus", "32"]')
    context: str | None = Field(
        default=None, description="build context for `gpuctl image build` and ship: build; null = gpuctl's source tree"
    )
    dockerfile: str = Field(default="Dockerfile", description="Dockerfile, relative to the context")


class GpuctlConfig(Strict):
    name: str | None = Field(
        default=None,
        pattern=r"^[a-z0-9][a-z0-9-]{0,39}$",
        description='cluster name (lowercase, digits, dashes); null = "<provider>-<folder name>"',
    )
    provider: Provider = Field(default_factory=LocalProvider)
    train: TrainConfig = Field(default_factory=TrainConfig)
    storage: StorageConfig = Field(default_factory=StorageConfig)
    # unset: after-train on a renting provider (vast, runpod, aws), never on local and ssh (_default_teardown)
    teardown: Literal["never", "after-train"] = Field(
        default="never",
        description="after-train: the node deletes itself when the run ends, once the final checkpoint is "
        "stored. Unset: after-train on vast, runpod and aws (they bill until deleted), never elsewhere",
    )
    docker: DockerConfig = Field(default_factory=DockerConfig)
    recovery: RecoveryConfig = Field(default_factory=RecoveryConfig)  # a lost node: core/recovery.py
    env: dict[str, str] = Field(
        default_factory=dict,
        description="extra environment for the training ranks, e.g. NCCL_DEBUG: INFO (not secret: it is in launch.sh)",
    )
    secrets: list[str] = Field(
        default_factory=list,
        max_length=64,
        description="names of variables (HF_TOKEN, WANDB_API_KEY) read from this machine's environment at `gpuctl train` and handed to the ranks only through the node's 0600 secrets.env: never in a command line, log, bundle or state file",
    )

    # Where the file was read from; relative paths resolve against it.
    base_dir: Path = Field(default_factory=Path.cwd, exclude=True)

    @model_validator(mode="before")
    @classmethod
    def _default_teardown(cls, data: object) -> object:
        """A rented node bills until it is deleted: unless gpuctl.yaml says otherwise, it deletes itself
        once the run ends (after the final checkpoint is stored). `never` only where it is written."""
        if isinstance(data, dict) and "teardown" not in data:
            prov = data.get("provider")
            kind = prov.get("kind") if isinstance(prov, dict) else getattr(prov, "kind", None)
            if kind in RENTING:
                return {**data, "teardown": "after-train"}
        return data

    @field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str]) -> dict[str, str]:
        for key in env:
            if not ENV_NAME.match(key):
                raise ValueError(f"env name {key!r} is not a valid variable name")
        return env

    @field_validator("secrets")
    @classmethod
    def _secret_names(cls, names: list[str]) -> list[str]:
        for name in names:
            if not ENV_NAME.match(name):
                raise ValueError(f"{name[:80]!r} is not a valid variable name")
            if name.startswith("GPUCTL_") or name in RESERVED_SECRETS:
                raise ValueError(f"{name} is a name gpuctl sets itself")
        if len(set(names)) != len(names):
            raise ValueError("a name is listed twice")
        return names

    @model_validator(mode="after")
    def _secrets_not_in_env(self) -> GpuctlConfig:
        both = sorted(set(self.secrets) & set(self.env))
        if both:
            raise ValueError(f"{both[0]} is in both env and secrets; a secret belongs in secrets only")
        return self

    @property
    def cluster_name(self) -> str:
        if self.name:
            return self.name
        slug = re.sub(r"[^a-z0-9-]+", "-", self.base_dir.name.lower()).strip("-")[:30]
        return f"{self.provider.kind}-{slug or 'default'}"

    def data_path(self) -> Path | None:
        """The local data file to ship, or None for the built-in sample / remote data."""
        if self.train.data == "sample" or self.train.data.startswith("s3://"):
            return None
        return (self.base_dir / self.train.data).resolve()

    def storage_settings(self, *, for_node: bool = False) -> dict[str, object]:
        """`storage` as trainer.objstore's CheckpointStore.from_config reads it, url made absolute.

        for_node: without the laptop's AWS profile (the node has none; its credentials come
        in secrets.env)."""
        settings = self.storage.model_dump()
        settings["url"] = self.storage_url()
        if for_node:
            settings["profile"] = None
        return settings

    def storage_url(self) -> str:
        """The storage url with a bare path made absolute against the config's folder."""
        if urlparse(self.storage.url).scheme:
            return self.storage.url
        return (self.base_dir / self.storage.url).resolve().as_uri()


def check_storage_for_nodes(cfg: GpuctlConfig) -> None:
    """`up` and `train` on a renting provider: the checkpoints must outlive the node."""
    if cfg.provider.kind not in RENTING:
        return
    url = cfg.storage.url
    if url == STORAGE_PLACEHOLDER:
        raise ConfigError(
            f"storage.url is still the placeholder {url}",
            "set storage.url in gpuctl.yaml to your bucket, e.g. s3://my-bucket/gpuctl (`gpuctl init --storage URL`)",
        )
    if urlparse(url).scheme != "s3" and not cfg.storage.node_local:
        raise ConfigError(
            f"storage.url {url} is a path on the rented {cfg.provider.kind} node: its checkpoints go with the node",
            "set storage.url to s3://bucket/prefix, or storage.node_local: true to accept losing them",
        )


def world_size(cfg: GpuctlConfig, slots_per_node: list[int]) -> int:
    return sum(slots_per_node)


def check_batch(train: TrainConfig, world: int) -> int:
    """train_batch_size = micro_batch x grad_accum x world; a disagreeing user value is an error."""
    product = train.micro_batch * train.grad_accum * world
    if train.train_batch_size is not None and train.train_batch_size != product:
        raise ConfigError(
            f"train.train_batch_size is {train.train_batch_size} but micro_batch {train.micro_batch}"
            f" x grad_accum {train.grad_accum} x {world} ranks = {product}",
            "set train_batch_size to the product, or remove it and let gpuctl compute it",
        )
    return product


def _format_validation(err: ValidationError, path: Path) -> ConfigError:
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"] if not str(p).endswith("Provider")) or "(top level)"
    # Discriminated unions put the kind into loc; drop those, keep the field path.
    where = re.sub(r"\.(local|ssh|vast|runpod|aws)(?=\.|$)", "", where, count=1)
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        msg, fix = "unknown key", "remove it or fix its spelling (see `gpuctl init` for every key)"
    elif first["type"] == "union_tag_invalid":
        msg, fix = "unknown provider kind", "use one of local, ssh, vast, runpod, aws, slurm"
    else:
        fix = f"correct {where} in {path.name}"
    kind = next((str(p) for p in first["loc"][1:2] if first["loc"][0] == "provider" and str(p) in RENTING), None)
    if kind and first["type"] != "union_tag_invalid":  # e.g. a local config whose kind was changed by hand
        fix += f"; `gpuctl init --provider {kind} FILE` writes a {kind} config with every key it takes"
    more = f" (+{len(err.errors()) - 1} more)" if len(err.errors()) > 1 else ""
    return ConfigError(f"{path}: {where}: {msg}{more}", fix)


def load_config(path: Path | None = None) -> GpuctlConfig:
    """Read and validate gpuctl.yaml (cwd by default). Raises ConfigError with one clear line."""
    path = Path(path) if path else Path.cwd() / CONFIG_NAME
    if not path.is_file():
        raise ConfigError(f"no config at {path}", "run `gpuctl init` or pass -c PATH")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: byte {exc.start} is not UTF-8 text", "save the file as UTF-8") from None
    try:
        raw = yaml.load(text, Loader=UniqueKeyLoader) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        problem = str(getattr(exc, "problem", None) or exc)
        fix = "keep one of them" if "appears twice" in problem else "fix the YAML syntax"
        raise ConfigError(f"{path}:{where} is not valid YAML ({' '.join(problem.split())[:300]})", fix) from None
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply to read", "write the config as plain mappings") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping of keys", "see `gpuctl init`")
    try:
        cfg = GpuctlConfig.model_validate({**raw, "base_dir": path.parent.resolve()})
    except ValidationError as err:
        raise _format_validation(err, path) from None
    _check_files(cfg, path)
    return cfg


def _check_files(cfg: GpuctlConfig, path: Path) -> None:
    data = cfg.data_path()
    if data is not None and not data.is_file():
        raise ConfigError(
            f"{path}: train.data: file {data} does not exist",
            "point train.data at a .txt/.jsonl/.parquet file, or use 'sample'",
        )
    if data is not None and data.suffix not in (".txt", ".jsonl", ".parquet"):
        raise ConfigError(
            f"{path}: train.data: {data.name} is not .txt, .jsonl or .parquet", "convert the data or use 'sample'"
        )
    remote = cfg.train.data if cfg.train.data.startswith("s3://") else None
    if remote is not None and PurePosixPath(urlparse(remote).path).suffix not in (".txt", ".jsonl", ".parquet"):
        raise ConfigError(
            f"{path}: train.data: {remote} is not a .txt, .jsonl or .parquet object",
            "point train.data at s3://bucket/path/file.jsonl (or .txt / .parquet)",
        )
    model = cfg.train.model
    if model.startswith((".", "/", "~")) and not Path(model).expanduser().exists():
        raise ConfigError(f"{path}: train.model: {model} does not exist", "give an HF id or a model folder")
    prov = cfg.provider
    if isinstance(prov, SSHProvider) and prov.identity_file:
        if not Path(prov.identity_file).expanduser().is_file():
            raise ConfigError(
                f"{path}: provider.identity_file: {prov.identity_file} does not exist",
                "point it at your SSH private key",
            )
    if isinstance(prov, LocalProvider) and prov.python and not shutil.which(prov.python):
        raise ConfigError(f"{path}: provider.python: {prov.python} not found", "give a python with torch")
