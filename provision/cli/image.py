"""Image commands: build the trainer image here, ship it to docker nodes."""

from __future__ import annotations

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
) -> None:
    """docker build the trainer image here (context: docker.context); --push uploads it."""
    from provision.flows import image

    cfg = load(config)
    name = tag or image.image_name(cfg)
    found = image.build(cfg, name, push=push, say=say)
    say(f"built {name} ({found[:19]}){'; pushed' if push else ''}")


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
