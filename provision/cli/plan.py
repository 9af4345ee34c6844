"""`gpuctl plan`: will the config fit, and how fast might it go (pure computation, no machine)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from provision.cli.options import ConfigOpt, load_if_present

if TYPE_CHECKING:
    from provision.core.config import GpuctlConfig

app = typer.Typer()


@app.command()
def plan(
    config: ConfigOpt = None,
    model: Annotated[Optional[str], typer.Option(help="deepseek-7b, tiny, or an HF id gpuctl knows")] = None,
    gpus: Annotated[Optional[int], typer.Option(help="GPUs per node")] = None,
    nodes: Annotated[Optional[int], typer.Option(help="nodes")] = None,
    gpu: Annotated[Optional[str], typer.Option(help="GPU model, e.g. 'RTX 4090', A100, H100")] = None,
    gpu_mem: Annotated[Optional[float], typer.Option("--gpu-mem", help="GB per GPU")] = None,
    zero_stage: Annotated[Optional[int], typer.Option("--zero-stage")] = None,
    offload: Annotated[Optional[str], typer.Option(help="none | cpu")] = None,
    micro_batch: Annotated[Optional[int], typer.Option("--micro-batch")] = None,
    grad_accum: Annotated[Optional[int], typer.Option("--grad-accum")] = None,
    seq_len: Annotated[Optional[int], typer.Option("--seq-len")] = None,
    checkpointing: Annotated[Optional[bool], typer.Option("--checkpointing/--no-checkpointing")] = None,
    precision: Annotated[Optional[str], typer.Option(help="fp16 | bf16 | fp32")] = None,
    strategy: Annotated[
        Optional[str], typer.Option(help="deepspeed | fsdp (default: train.strategy); fsdp adds FSDP2's figures")
    ] = None,
    checkpoint_every: Annotated[
        Optional[int], typer.Option("--checkpoint-every", min=0, help="steps between saves (default: train's)")
    ] = None,
    upload_mbps: Annotated[
        Optional[float],
        typer.Option(
            "--upload-mbps",
            min=0.001,
            help="node -> store MB/s (default: the cluster's last `gpuctl doctor` put figure, else 50)",
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="figures for scripts")] = False,
) -> None:
    """GPU memory per rank, host RAM per node (load, steady, resume) and disk, the closest config that fits,
    tokens/s, and what a checkpoint save costs (size on disk and in the store, upload time)."""
    from provision.estimate.plan import plan as run_plan
    from provision.estimate.plan import plan_to_json
    from provision.estimate.plan_input import PlanInput

    cfg = load_if_present(config)
    strategy = strategy or (cfg.train.strategy if cfg else "deepspeed")
    if strategy not in ("deepspeed", "fsdp"):
        from provision.core.errors import ConfigError

        raise ConfigError(f"--strategy {strategy!r} is not deepspeed or fsdp", "pass --strategy deepspeed or fsdp")
    base = plan_defaults(cfg)
    flags = dict(
        model=model,
        gpus_per_node=gpus,
        nodes=nodes,
        gpu=gpu,
        gpu_mem_gb=gpu_mem,
        zero_stage=zero_stage,
        offload_optimizer=offload,
        micro_batch=micro_batch,
        grad_accum=grad_accum,
        seq_len=seq_len,
        gradient_checkpointing=checkpointing,
        precision=precision,
    )
    base.update({k: v for k, v in flags.items() if v is not None}, strategy=strategy)
    result = run_plan(PlanInput(**base))
    if checkpoint_every is None:  # gpuctl.yaml's, else train's default
        from provision.core.config import TrainConfig

        checkpoint_every = (cfg.train if cfg else TrainConfig()).checkpoint_every
    step = _step_model(result, cfg, checkpoint_every, gpu)
    # the saves' pace: steps without what the saves themselves add (amortised over checkpoint_every, so
    # counting them here would make the "every that keeps up" depend on itself)
    saves = [t for t in step.terms if t.name in ("checkpoint", "upload cpu")]
    pace = (step.fast_s - sum(t.fast_s for t in saves), step.slow_s - sum(t.slow_s for t in saves))
    cost = _save_cost(result, cfg, checkpoint_every, upload_mbps, strategy, pace)
    if strategy == "fsdp":
        _plan_fsdp(result, as_json, cost, step)
        return
    from provision.estimate.checkpoint_cost import cost_to_json
    from provision.estimate.step_time import model_to_json

    if as_json:
        out = plan_to_json(result) | {"checkpoint": cost_to_json(cost), "step_time": model_to_json(step)}
        typer.echo(json.dumps(out, indent=2))
        return
    from rich.console import Console

    from provision.cli.step_view import print_step
    from provision.cli.views import plan_table

    console = Console()
    console.print(plan_table(result))
    _print_cost(console, cost)
    print_step(console, step, cfg.train.max_steps if cfg else None)


def _step_model(result: Any, cfg: GpuctlConfig | None, checkpoint_every: int, gpu_flag: str | None) -> Any:
    """The step-time model: with the config's cluster recorded (and no --gpu), its nodes' kind and the rates
    its last `gpuctl doctor` measured; else GPUs at the tables' rates."""
    from provision.estimate.step_time import predict

    accelerator, rates = "cuda", None
    if cfg is not None and gpu_flag is None:
        from provision.core import state

        rec = state.find_cluster(cfg.cluster_name)
        if rec is not None and rec.nodes:
            accelerator = rec.nodes[0].accelerator
            rates = rec.doctor.rates if rec.doctor is not None else None
    max_steps = cfg.train.max_steps if cfg else None
    return predict(
        result, accelerator=accelerator, doctor=rates, checkpoint_every=checkpoint_every, max_steps=max_steps
    )


def _save_cost(
    result: Any, cfg: GpuctlConfig | None, every: int, mbps: float | None, strategy: str, step_s: tuple[float, float]
) -> Any:
    """The checkpoint cost at --upload-mbps, else at the put throughput the cluster's last doctor measured."""
    from provision.estimate.checkpoint_cost import checkpoint_cost, measured_put_mbps

    source = "--upload-mbps"
    if mbps is None and cfg is not None:
        from provision.core import state

        rec = state.find_cluster(cfg.cluster_name)
        if rec is not None and rec.doctor is not None:
            mbps = measured_put_mbps(rec.doctor.rows)
            source = f"measured by `gpuctl doctor` on cluster {rec.name} (storage put)"
    return checkpoint_cost(result, every, mbps, source, strategy, step_s)


def _print_cost(console: Any, cost: Any) -> None:
    from rich.table import Column, Table

    from provision.estimate.checkpoint_cost import seconds

    gb = 1e9
    table = Table("checkpoint save", Column("", justify="right"), title=f"checkpoints ({cost.strategy})")
    table.add_row("size on node 0's disk", f"{cost.node_bytes / gb:,.2f} GB")
    table.add_row("size in the store", f"{cost.store_bytes / gb:,.2f} GB")
    table.add_row(f"upload at {cost.upload_mbps:g} MB/s per node", seconds(cost.upload_s))
    every = cost.save_every_s
    table.add_row(
        "a save every", "end of run only" if every is None else f"{cost.checkpoint_every} steps, ~{seconds(every)}"
    )
    table.add_row(f"node disk for keep_local {cost.keep_local} (+1 being written)", f"{cost.disk_bytes / gb:,.2f} GB")
    console.print(table)
    console.print(f"upload bandwidth: {cost.upload_source}")
    if cost.warning():
        console.print(f"[yellow]warning: {cost.warning()}[/]")


def _plan_fsdp(result: Any, as_json: bool, cost: Any, step: Any) -> None:
    """FSDP2's per-rank figures (provision.estimate.fsdp) beside DeepSpeed's, and which fits better."""
    from provision.estimate.checkpoint_cost import cost_to_json
    from provision.estimate.fsdp import fsdp_memory, fsdp_to_json
    from provision.estimate.plan import plan_to_json
    from provision.estimate.step_time import model_to_json

    fsdp = fsdp_memory(result.input)
    figures = fsdp_to_json(result, fsdp)
    if as_json:
        out = plan_to_json(result) | {
            "strategy": "fsdp",
            "fsdp": figures,
            "checkpoint": cost_to_json(cost),
            "step_time": model_to_json(step),
        }
        typer.echo(json.dumps(out, indent=2))
        return
    from rich.console import Console
    from rich.table import Column, Table

    inp = result.input
    where = " on host" if fsdp.offloaded else ""
    table = Table(
        "per rank",
        Column("GB", justify="right"),
        title=f"FSDP2: {result.model.name} on {inp.total_gpus}x {result.gpu.name}, offload {inp.offload_optimizer}, "
        f"{inp.precision}, micro {inp.micro_batch} x seq {inp.seq_len}"
        f"{', checkpointing' if inp.gradient_checkpointing else ''}",
    )
    for label, gb in (
        (f"weights shard (fp32){where}", fsdp.params_gb),
        (f"gradients shard (fp32){where}", fsdp.grads_gb),
        (f"optimizer shard (Adam m, v){where}", fsdp.optimizer_gb),
        ("gathered units (params + grads)", fsdp.gathered_gb),
        ("activations", fsdp.activations_gb),
        ("fragmentation", fsdp.fragmentation_gb),
        ("CUDA context", fsdp.cuda_context_gb),
    ):
        table.add_row(label, f"{gb:.2f}")
    style = "bold " + ("green" if figures["fits"] else "red")
    table.add_row("GPU total", f"{fsdp.gpu_gb:.2f} / {result.gpu_capacity_gb:g}", style=style)
    from provision.cli.views import node_table

    console = Console()
    console.print(table)
    console.print(node_table(result))
    console.print(f"better for this config: [bold]{figures['better_strategy']}[/] ({figures['why']})")
    _print_cost(console, cost)
    from provision.cli.step_view import print_step

    print_step(console, step, step.max_steps)


def plan_defaults(cfg: GpuctlConfig | None) -> dict[str, Any]:
    """The run's own gpuctl.yaml as plan input (provision.estimate.sizing); the seed setup without one."""
    from provision.estimate.sizing import plan_input

    return plan_input(cfg)
