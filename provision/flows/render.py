"""jinja2 environment over templates/ -> a run bundle (see docs/CONTRACTS.md).

Values reach JSON through the `json` filter and shell through `q` (shlex.quote) and
`qjoin` (shlex.join): a path with `;` or `$(...)` in it arrives at the node verbatim.
A `templates/` folder beside the user's gpuctl.yaml overrides any template by name.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2

from provision.core.config import GpuctlConfig, check_batch
from provision.core.errors import ConfigError
from trainer.objstore.atomic import atomic_write

TEMPLATES = {
    "hostfile": "hostfile.j2",
    "ds_config.json": "ds_config.json.j2",
    "launch.sh": "launch.sh.j2",
    ".deepspeed_env": "deepspeed_env.j2",
}
# NCCL hangs without these on RTX 40-series (no NVLink, P2P disabled by the driver).
RTX40_NCCL = {"NCCL_P2P_DISABLE": "1", "NCCL_IB_DISABLE": "1"}
# .deepspeed_env values are wrapped in double quotes by DeepSpeed, not escaped.
UNSAFE_DS_ENV = re.compile(r'["$`\\\n]')
# Secrets (secrets.env, 0600) reach the ranks only through that file: each rank reads its node's
# copy itself (trainer/secrets_file.py). Neither .deepspeed_env (DeepSpeed writes its lines onto
# pdsh's command line and logs it) nor the launcher's environment (DeepSpeed copies MLFLOW*,
# PYTHON*, MV2*, UCX*, NCCL* variables onto that line, and logs every *NCCL* one) may carry them.
SECRETS_FILE = "secrets.env"


@dataclass
class BundleNode:
    host: str
    slots: int


@dataclass
class BundleSpec:
    """Everything the templates need that is not in the config itself."""

    run_id: str
    run_dir: str  # absolute path on the first node
    nodes: list[BundleNode]
    python: str
    accelerator: str = "cpu"  # cpu | cuda
    gpu_name: str | None = None
    master_addr: str = "127.0.0.1"
    ssh_port: int | None = None
    resume: str | None = None
    setup: str | None = None
    after_run: list[list[str]] = field(default_factory=list)
    secrets: dict[str, str] = field(default_factory=dict)
    launcher_prefix: list[str] = field(default_factory=list)  # e.g. a `docker run ...` wrapper
    # Multi-node: the first node's ssh config pdsh uses to reach every node (provision/mesh.py):
    # per-node Port/User/key and pinned host keys, so no --ssh_port and no DeepSpeed ssh check.
    ssh_config: str | None = None
    # "slurm": the job's nodes are Slurm's to pick: srun starts one launcher per node (slurm_launcher),
    # and nodes holds placeholders of their count and slots; the batch script writes the real hostfile.
    scheduler: str | None = None

    @property
    def world_size(self) -> int:
        return sum(n.slots for n in self.nodes)


def packaged_templates() -> Path:
    package = Path(__file__).resolve().parents[1]  # provision/
    wheel = package / "templates"  # the wheel carries them inside the package
    return wheel if wheel.is_dir() else package.parent / "templates"


def template_env(config_dir: Path | None) -> jinja2.Environment:
    search = [str(packaged_templates())]
    if config_dir is not None and (config_dir / "templates").is_dir():
        search.insert(0, str(config_dir / "templates"))
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(search),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters["q"] = lambda value: shlex.quote(str(value))
    env.filters["qjoin"] = lambda argv: shlex.join(str(a) for a in argv)
    env.filters["json"] = json.dumps
    env.globals["fp16_scale_power"] = fp16_scale_power
    return env


def fp16_scale_power(max_steps: int) -> int:
    """fp16's first loss scale is 2^this (ds_config initial_scale_power). DeepSpeed's dynamic scaler skips
    every step whose gradients overflow and halves the scale after `hysteresis` (2) overflows
    (deepspeed/runtime/fp16/loss_scaler.py DynamicLossScaler.update_scale l.253-275), and doubles it only
    after loss_scale_window (1000) clean steps: a start above what the model needs costs one skipped step
    per halving + 1. DeepSpeed starts at 2^16; a short run starts at 2^12, one power more per 50 steps."""
    return min(16, 12 + max(0, max_steps) // 50)


def rank_env(cfg: GpuctlConfig, spec: BundleSpec) -> dict[str, str]:
    """The ranks' environment. CPU threads of GPU ranks are not set here: each rank takes its share of the
    node's physical cores itself (trainer/hostenv.py), unless gpuctl.yaml's env sets OMP_NUM_THREADS."""
    env: dict[str, str] = {}
    if spec.accelerator == "cpu":
        env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    else:  # the allocator grows segments instead of stranding 2 MB-aligned blocks (fragmentation)
        env.update(PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    if spec.gpu_name and re.search(r"RTX 40\d0|RTX 4090|RTX 4080|RTX 4070", spec.gpu_name):
        env.update(RTX40_NCCL)
    env.update(cfg.env)  # the user's word wins, NCCL overrides included
    return env


def slurm_launcher(spec: BundleSpec, strategy: str) -> list[str]:
    """One step of the Slurm job, one task per node: trainer/slurm_node.py starts that node's ranks (DeepSpeed's
    per-node launcher or torchrun) at Slurm's node rank; launch.sh appends --master_port and the trainer's argv.
    The step's environment is launch.sh's (--export=ALL): no secret is in it (they stay in secrets.env)."""
    slots = spec.nodes[0].slots
    srun = ["srun", "--export=ALL", f"--nodes={len(spec.nodes)}", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    return [*srun, *spec.launcher_prefix, spec.python, "-u", "-m", "trainer.slurm_node", strategy, str(slots)]


def launcher_argv(spec: BundleSpec, strategy: str = "deepspeed") -> list[str]:
    """launch.sh's launcher: under Slurm one srun step for either strategy, else DeepSpeed's runner (which
    fsdp's torchrun.sh replaces, torchrun_context)."""
    if spec.scheduler == "slurm":
        return slurm_launcher(spec, strategy)
    argv = [
        *spec.launcher_prefix,
        spec.python,
        "-u",
        "-m",
        "deepspeed.launcher.runner",
        "--hostfile",
        "hostfile",
        "--master_addr",
        spec.master_addr,
        "--no_local_rank",
    ]
    if len(spec.nodes) == 1:
        argv.append("--no_ssh_check")  # one host: DeepSpeed launches locally, no pdsh
    else:
        argv += ["--launcher", "pdsh"]
        if spec.ssh_config:  # gpuctl checked node-to-node SSH at `up`; DeepSpeed's check ignores -F
            argv.append("--no_ssh_check")
        elif spec.ssh_port:
            argv += ["--ssh_port", str(spec.ssh_port)]
    return argv


def run_json(cfg: GpuctlConfig, spec: BundleSpec, data_rel: str) -> dict[str, Any]:
    train = cfg.train.model_dump(exclude={"train_batch_size"})
    train["data"] = data_rel
    return {
        "run_id": spec.run_id,
        "ds_config": "ds_config.json",
        "num_nodes": len(spec.nodes),
        "train": train,
        "storage": cfg.storage_settings(for_node=True),
        "resume": spec.resume,
        "collective_timeout_s": collective_timeout(cfg, spec),
        "shared_dir": spec.scheduler == "slurm",  # one run dir on the shared filesystem for every node
    }


def collective_timeout(cfg: GpuctlConfig, spec: BundleSpec) -> int:
    """The process group's timeout: plan's figure from the checkpoint and data sizes (provision.estimate
    .node.collective_timeout_s), the 30-minute floor for models plan does not know."""
    from provision.estimate.hardware import KNOWN_MODELS, PlanError
    from provision.estimate.node import TIMEOUT_FLOOR_S, collective_timeout_s
    from provision.estimate.plan_input import PlanInput
    from provision.estimate.sizing import plan_input

    fields = plan_input(cfg) | {"gpus_per_node": max(n.slots for n in spec.nodes), "nodes": len(spec.nodes)}
    if spec.gpu_name:
        fields["gpu"] = spec.gpu_name
    if fields.get("model") not in KNOWN_MODELS:
        return TIMEOUT_FLOOR_S
    for gpu in (fields.get("gpu", "RTX 4090"), "RTX 4090"):  # a GPU plan's table lacks: sizes hold anyway
        try:
            return collective_timeout_s(PlanInput(**(fields | {"gpu": gpu})))[0]
        except PlanError:
            continue
    return TIMEOUT_FLOOR_S


def render_bundle(cfg: GpuctlConfig, spec: BundleSpec, out_dir: Path) -> Path:
    """Write the run bundle into out_dir. Touches no machine."""
    batch = check_batch(cfg.train, spec.world_size)
    env = rank_env(cfg, spec)
    over_pdsh = len(spec.nodes) > 1 and spec.scheduler is None  # Slurm's srun passes the environment as it is
    if over_pdsh:
        bad = [k for k, v in env.items() if UNSAFE_DS_ENV.search(v)]
        if bad:
            raise ConfigError(
                f"env.{bad[0]} has a quote, $, backslash or newline, which DeepSpeed's multi-node launcher cannot pass",
                "simplify the value",
            )
    out_dir.mkdir(parents=True, exist_ok=True)
    data_rel = _ship_data(cfg, out_dir)
    context = dict(
        run_id=spec.run_id,
        run_dir=spec.run_dir,
        nodes=spec.nodes,
        train=cfg.train,
        train_batch_size=batch,
        accelerator=spec.accelerator,
        env=env,
        python=spec.python,
        world_size=spec.world_size,
        setup=spec.setup,
        launcher=launcher_argv(spec, cfg.train.strategy),
        script=["--module", "trainer", "run.json"],
        after_run=spec.after_run,
        ssh_config=spec.ssh_config if over_pdsh else None,
    )
    templates = dict(TEMPLATES)
    if cfg.train.strategy == "fsdp" and spec.scheduler is None:  # torchrun.sh (torchrun_context below); Slurm: srun
        context.update(torchrun_context(spec))
        templates[TORCHRUN_SCRIPT] = TORCHRUN_TEMPLATE
    jinja = template_env(cfg.base_dir)
    for name, template in templates.items():
        try:
            text = jinja.get_template(template).render(**context)
        except jinja2.TemplateError as exc:
            raise ConfigError(f"template {template}: {exc}", "fix or remove your override in templates/") from None
        mode = 0o755 if name.endswith(".sh") else 0o600 if name.startswith(".") else 0o644
        atomic_write(out_dir / name, text, mode)
    json.loads((out_dir / "ds_config.json").read_text())  # a broken override fails here, not on the node
    atomic_write(out_dir / "run.json", json.dumps(run_json(cfg, spec, data_rel), indent=2) + "\n")
    if spec.secrets:
        atomic_write(out_dir / SECRETS_FILE, secrets_text(spec.secrets), 0o600)
    _ship_trainer(out_dir / "lib" / "trainer")
    return out_dir


# train.strategy fsdp: the bundle launches torchrun (templates/torchrun.sh.j2) instead of DeepSpeed's runner.
# launch.sh stays the same job script (status.json, job.log, cancel by process group); only the command it
# starts differs: `bash torchrun.sh --master_port P`. torchrun.sh holds what the hostfile holds for DeepSpeed
# (every node, its slots, the rendezvous address) and starts one torchrun per node.
TORCHRUN_TEMPLATE = "torchrun.sh.j2"
TORCHRUN_SCRIPT = "torchrun.sh"


def torchrun_context(spec: BundleSpec) -> dict[str, Any]:
    """What launch.sh.j2 and torchrun.sh.j2 need for an fsdp run."""
    script = f"{spec.run_dir}/{TORCHRUN_SCRIPT}"
    return {
        "launcher": ["bash", script],  # launch.sh appends --master_port "$MASTER_PORT"
        "script": [],
        "torchrun": [*spec.launcher_prefix, spec.python, "-u", "-m", "torch.distributed.run"],
        "trainer_args": ["--module", "trainer", "run.json"],
        "master_addr": spec.master_addr,
        # the command each other node's shell runs (ssh appends the port)
        "remote": [shlex.join(["bash", script, "--node", str(rank)]) for rank in range(1, len(spec.nodes))],
    }


def secrets_text(values: dict[str, str]) -> str:
    """secrets.env: NAME='value' lines that bash's `.` and trainer/secrets_file.parse read alike."""
    return "".join(f"{k}={shlex.quote(v)}\n" for k, v in values.items())


def render_ds_config(cfg: GpuctlConfig, accelerator: str, world: int) -> dict[str, Any]:
    """The ds_config gpuctl would render for this config on `world` ranks of `accelerator` (cpu | cuda),
    without writing a bundle (benchmarks/gpu_check.py trains with it)."""
    text = (
        template_env(cfg.base_dir)
        .get_template(TEMPLATES["ds_config.json"])
        .render(
            train=cfg.train,
            train_batch_size=check_batch(cfg.train, world),
            accelerator=accelerator,
            run_id="gpu-check",
        )
    )
    config: dict[str, Any] = json.loads(text)
    return config


def _ship_data(cfg: GpuctlConfig, out_dir: Path) -> str:
    source = cfg.data_path()
    if source is None:
        return cfg.train.data
    (out_dir / "data").mkdir(exist_ok=True)
    target = out_dir / "data" / source.name
    if not target.exists():
        try:
            os.link(source, target)  # same filesystem: no copy of a large file
        except OSError:
            shutil.copy2(source, target)
    return f"data/{source.name}"


def _ship_trainer(target: Path) -> None:
    import trainer  # the light package object only; trainer/__init__ imports no torch

    source = Path(trainer.__file__).resolve().parent
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
