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
    as_json: Annotated[bool, typer.Option("--json", help="figures for scripts")] = False,
) -> None:
    """GPU memory per rank, host RAM per node (load, steady, resume) and disk, the closest config that fits,
    tokens/s."""
    from provision.estimate.plan import PlanInput, plan_to_json
    from provision.estimate.plan import plan as run_plan

    base = plan_defaults(load_if_present(config))
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
    base.update({k: v for k, v in flags.items() if v is not None})
    result = run_plan(PlanInput(**base))
    if as_json:
        typer.echo(json.dumps(plan_to_json(result), indent=2))
        return
    from rich.console import Console

    from provision.cli.views import plan_table

    Console().print(plan_table(result))


def plan_defaults(cfg: GpuctlConfig | None) -> dict[str, Any]:
    """The run's own gpuctl.yaml as plan input (provision.estimate.sizing); the seed setup without one."""
    from provision.estimate.sizing import plan_input

    return plan_input(cfg)
