"""`gpuctl doctor`: check every node of the cluster before paying for a run."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from provision.cli.options import ConfigOpt, JsonOpt, load, say

app = typer.Typer()


@app.command()
def doctor(
    config: ConfigOpt = None,
    as_json: JsonOpt = False,
    quick: Annotated[bool, typer.Option("--quick", help="the seconds-long checks `up` runs (no benchmarks)")] = False,
) -> None:
    """Check every node: GPUs, PCIe, P2P, all-reduce bandwidth, RAM, /dev/shm, disk, clock, torch/DeepSpeed, storage."""
    from provision.core import state
    from provision.flows.doctor import run_checks

    cfg = load(config)
    result = run_checks(cfg, state.load_cluster(cfg.cluster_name), quick=quick, say=say)
    if as_json:
        typer.echo(json.dumps(result.model_dump(), indent=2))
    else:
        from provision.cli.doctor_view import print_checks

        print_checks(result)
    if result.failing():
        raise typer.Exit(1)
