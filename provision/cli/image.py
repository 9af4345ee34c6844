"""Image commands: build the trainer image here, ship it to docker nodes."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from provision.cli.options import ClusterOpt, ConfigOpt, load, say

app = typer.Typer(help="The trainer image: build it here, ship it to docker nodes.", no_args_is_help=True)
TagOpt = Annotated[Optional[str], typer.Option("--tag", "-t", help="image name (default: provider.image)")]


@app.command("build")
def build(
    config: ConfigOpt = None,
    tag: TagOpt = None,
    push: Annotated[bool, typer.Option("--push", help="push to the registry after building")] = False,
    flavour: Annotated[
        str, typer.Option("--flavour", help="cuda (CUDA base, the GPU nodes' image) | cpu (Debian base, CPU torch)")
    ] = "cuda",
    base: Annotated[Optional[str], typer.Option("--base", help="base image instead of the flavour's")] = None,
    torch_index_url: Annotated[
        Optional[str], typer.Option("--torch-index-url", help="package index with the flavour's torch wheel")
    ] = None,
    network: Annotated[
        Optional[str], typer.Option("--network", help="docker build --network (host: an engine without a bridge)")
    ] = None,
    ca_certs: Annotated[
        Optional[Path],
        typer.Option("--ca-certs", help="PEM file of extra CAs pip trusts during the build (a TLS proxy)"),
    ] = None,
) -> None:
    """docker build the trainer image here (context: docker.context); --push uploads it."""
    from provision.flows import build as builder
    from provision.flows import image

    cfg = load(config)
    name = tag or image.image_name(cfg)
    opts = builder.BuildOptions(
        flavour=flavour, base=base, torch_index_url=torch_index_url, network=network, ca_certs=ca_certs, push=push
    )
    built = builder.build(cfg, name, opts, say=say)
    cached = f", {built.cached_steps}/{built.steps} steps cached" if built.steps else ""
    say(f"built {name} ({built.image_id[:19]}, {flavour}) in {built.seconds:.0f} s{cached}{'; pushed' if push else ''}")


@app.command("ship")
def ship(
    config: ConfigOpt = None,
    cluster: ClusterOpt = None,
    how: Annotated[
        Optional[str], typer.Option("--how", help="pull | load | build | auto (default: docker.ship)")
    ] = None,
) -> None:
    """Make every node of the cluster have the image; nodes that have it already are skipped."""
    from provision.core import state
    from provision.flows import image

    cfg = load(config)
    record = state.load_cluster(cluster or cfg.cluster_name)
    if record.runtime != "docker":
        say(f"cluster {record.name} runs with runtime {record.runtime}: nothing to ship")
        return
    for result in image.ship_cluster(cfg, record, say, how=how):
        say(f"{result.node}: {result.action} {(result.image_id or '')[:19]}")
