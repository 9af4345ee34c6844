"""Typer wiring only: parse, call one function, map errors to one line.

Heavy modules (fabric, boto3, jinja2, pydantic models) are imported inside the commands so
`gpuctl --help` stays fast. GPUCTL_DEBUG=1 shows the full traceback instead of one line.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path
from typing import Annotated, Callable, Optional

import typer

app = typer.Typer(help="Rent a few GPUs, train with DeepSpeed, sync checkpoints, tear down.",
                  no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False)

ConfigOpt = Annotated[Optional[Path], typer.Option("--config", "-c", help="gpuctl.yaml (default: ./gpuctl.yaml)")]
JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable output")]
YesOpt = Annotated[bool, typer.Option("--yes", "-y", help="do not ask for confirmation")]
RunArg = Annotated[Optional[str], typer.Argument(help="run id (default: the newest)")]


def debug() -> bool:
    return os.environ.get("GPUCTL_DEBUG", "") not in ("", "0")


def say(text: str) -> None:
    typer.echo(text, err=True)


def handled(func: Callable) -> Callable:
    """Turn GpuctlError into `error: ... (fix: ...)` and its exit code; no traceback."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        from provision.errors import GpuctlError

        try:
            return func(*args, **kwargs)
        except GpuctlError as exc:
            if debug():
                raise
            typer.echo(f"error: {exc.one_line()}", err=True)
            raise typer.Exit(exc.exit_code) from None

    return wrapper


def _config(path: Optional[Path]):
    from provision.config import load_config

    return load_config(path)


def _cluster_name(path: Optional[Path], cluster: Optional[str]) -> str:
    return cluster or _config(path).cluster_name


@app.command()
@handled
def init(path: Annotated[Path, typer.Argument(help="where to write")] = Path("gpuctl.yaml"),
         force: Annotated[bool, typer.Option(help="overwrite an existing file")] = False) -> None:
    """Write a gpuctl.yaml for the local provider with every field present and commented."""
    from provision.errors import ConfigError
    from provision.render import packaged_templates

    if path.exists() and not force:
        raise ConfigError(f"{path} exists", "pass --force to overwrite it")
    path.write_text((packaged_templates() / "gpuctl.yaml").read_text())
    say(f"wrote {path}; next: gpuctl up && gpuctl train")


@app.command()
@handled
def up(config: ConfigOpt = None, yes: YesOpt = False,
       dry_run: Annotated[bool, typer.Option("--dry-run", help="show what would be created")] = False) -> None:
    """Create (cloud) or connect (local, ssh) the cluster and record it."""
    from provision import cluster
    from provision.providers.base import UpOptions

    cfg = _config(config)
    confirm = (lambda q: True) if yes else (lambda q: typer.confirm(q, default=False, err=True))
    cluster.up(cfg, UpOptions(dry_run=dry_run, assume_yes=yes, confirm=confirm, say=say))


@app.command()
@handled
def offers(config: ConfigOpt = None, as_json: JsonOpt = False,
           limit: Annotated[int, typer.Option(help="rows to show")] = 15) -> None:
    """List the rentable machines that match the config's cloud provider, cheapest first."""
    from dataclasses import asdict

    from provision.errors import ConfigError
    from provision.providers import backend

    cfg = _config(config)
    provider = backend(cfg.provider.kind)
    if not hasattr(provider, "find_offers"):
        raise ConfigError(f"provider {cfg.provider.kind} rents nothing", "offers are for vast, runpod and aws")
    rows = provider.find_offers(cfg.provider)[:limit]
    if as_json:
        typer.echo(json.dumps([asdict(o) for o in rows], indent=2))
        return
    from provision.views import print_offers

    print_offers(rows, f"{cfg.provider.kind} offers {provider.filters_text(cfg.provider)}")


def _follow_to_end(run, detach_hint: bool = True) -> int:
    from provision import job

    try:
        status = job.follow(run, typer.echo)
    except KeyboardInterrupt:
        say(f"\ndetached; run {run.run_id} goes on. `gpuctl logs -f` reattaches, `gpuctl cancel` stops it")
        return 130
    say(f"run {run.run_id} {status.state}")
    job.fetch_results(run)  # `gpuctl report` works after `down`
    return job.exit_code_of(status)


@app.command()
@handled
def train(config: ConfigOpt = None,
          detach: Annotated[bool, typer.Option("--detach", "-d", help="return once the run started")] = False,
          dry_run: Annotated[bool, typer.Option("--dry-run", help="render and print, start nothing")] = False,
          resume: Annotated[bool, typer.Option("--resume", help="continue from the store's latest checkpoint")] = False,
          resume_from: Annotated[Optional[str], typer.Option(help="continue from this checkpoint TAG")] = None,
          ) -> None:
    """Run training on the cluster; follow the logs and exit with the run's exit code."""
    from provision import job, state

    cfg = _config(config)
    resume = resume_from or ("latest" if resume else None)
    if dry_run:
        _print_dry_run(cfg, resume)
        return
    from provision.config import check_batch

    record = state.find_cluster(cfg.cluster_name)
    check_batch(cfg.train, (record or _planned_cluster(cfg)).world_size)  # a config error comes first
    record = record or state.load_cluster(cfg.cluster_name)
    run = job.start_run(cfg, record, resume=resume, say=say)
    if detach:
        typer.echo(run.run_id)
        return
    raise typer.Exit(_follow_to_end(run))


def _print_dry_run(cfg, resume: Optional[str]) -> None:
    """Render into a temp dir and print what would run where."""
    import tempfile

    from provision import job, state
    from provision.render import render_bundle

    cluster = state.find_cluster(cfg.cluster_name) or _planned_cluster(cfg)
    spec = job.bundle_spec(cfg, cluster, "dry-run", resume)
    with tempfile.TemporaryDirectory() as tmp:
        out = render_bundle(cfg, spec, Path(tmp))
        typer.echo(f"# would ship to {cluster.name} and run in {spec.run_dir}:")
        for name in ("hostfile", "ds_config.json", "launch.sh"):
            typer.echo(f"--- {name}\n{(out / name).read_text()}")


def _planned_cluster(cfg):
    from provision.cluster import planned

    return planned(cfg)


@app.command()
@handled
def render(output: Annotated[Path, typer.Option("--output", "-o", help="bundle folder to write")],
           config: ConfigOpt = None) -> None:
    """Write the run bundle (hostfile, ds_config.json, launch.sh, ...) without touching a machine."""
    from provision import job
    from provision.render import render_bundle

    cfg = _config(config)
    from provision.credentials import StorageCredentials

    cluster = _planned_cluster(cfg)
    # No storage credentials in a folder the user keeps: `gpuctl train` hands them over itself.
    spec = job.bundle_spec(cfg, cluster, "rendered", credentials=StorageCredentials())
    spec.run_dir = str(output.resolve())
    render_bundle(cfg, spec, output.resolve())
    say(f"wrote {output}/: hostfile, ds_config.json, launch.sh, .deepspeed_env, run.json, lib/")


@app.command()
@handled
def status(run_id: RunArg = None, config: ConfigOpt = None, as_json: JsonOpt = False,
           cluster: Annotated[Optional[str], typer.Option(help="cluster name")] = None) -> None:
    """Show the cluster and the newest (or given) run."""
    from provision import job, state
    from provision.errors import NotFoundError, RemoteError

    name = cluster if (cluster or run_id) else _cluster_name(config, None)
    record = state.find_cluster(name) if name else None
    try:
        run = state.load_run(run_id, None if run_id else name)
        result = job.read_status(run, job.node_of(run)) if state.find_cluster(run.cluster) else None
    except NotFoundError:
        run, result = None, None
    except RemoteError as exc:  # e.g. a cloud node that tore itself down (teardown, budget cap)
        say(f"warning: cannot reach the node ({exc.message}); showing the last recorded state. "
            "A node that deleted itself is forgotten by `gpuctl down`")
        result = None
    info = {"cluster": state.dump(record) if record else None,
            "run": result.to_json() if result else (state.dump(run) if run else None)}
    if as_json:
        typer.echo(json.dumps(info, indent=2))
        return
    from provision.views import print_status

    print_status(info)


@app.command()
@handled
def logs(run_id: RunArg = None, config: ConfigOpt = None,
         follow: Annotated[bool, typer.Option("--follow", "-f", help="keep following until the run ends")] = False) -> None:
    """Print a run's job.log; -f follows it (also after a dropped connection)."""
    from provision import job, state

    run = state.load_run(run_id, None if run_id else _cluster_name(config, None))
    if follow:
        raise typer.Exit(_follow_to_end(run))
    job.follow(run, typer.echo, until_end=False)


@app.command()
@handled
def cancel(run_id: RunArg = None, config: ConfigOpt = None) -> None:
    """Stop a run through the process group launch.sh recorded."""
    from provision import job, state
    from provision.errors import RemoteError

    run = state.load_run(run_id, None if run_id else _cluster_name(config, None))
    if not job.cancel(run):
        raise RemoteError(f"run {run.run_id} did not stop", "retry `gpuctl cancel`")
    say(f"run {run.run_id} stopped")


@app.command()
@handled
def down(config: ConfigOpt = None, yes: YesOpt = False,
         cluster: Annotated[Optional[str], typer.Option(help="cluster name")] = None) -> None:
    """Stop the cluster's runs and terminate or disconnect its machines."""
    from provision import cluster as clusters
    from provision import state

    name = _cluster_name(config, cluster)
    record = state.find_cluster(name)
    if record and record.provider not in ("local", "ssh") and not yes:
        if not typer.confirm(f"terminate {len(record.nodes)} {record.provider} node(s) of {name}?", err=True):
            raise typer.Exit(1)
    clusters.down(name, say)


@app.command(context_settings={"allow_interspersed_args": False})
@handled
def ssh(command: Annotated[Optional[list[str]], typer.Argument(
            help="one argument: a shell command line; several: a command and its arguments, passed verbatim; "
                 "none: a login shell")] = None,
        node: Annotated[int, typer.Option("--node", "-n", help="node index (0 = first)")] = 0,
        config: ConfigOpt = None,
        cluster: Annotated[Optional[str], typer.Option(help="cluster name")] = None) -> None:
    """Open a shell (or run a command) on a node, checking the host key gpuctl pinned."""
    import subprocess

    from provision.sshconfig import ssh_argv

    raise typer.Exit(subprocess.call(ssh_argv(_cluster_name(config, cluster), node, command or [])))


@app.command("forget-host")
@handled
def forget_host(host: Annotated[str, typer.Argument(help="host, host:port or user@host:port")]) -> None:
    """Forget a host's pinned SSH key (after the machine was really reinstalled)."""
    from provision.ssh import forget_host as forget

    removed = forget(host)
    say(f"forgot {removed} pinned key(s) of {host}; the next `gpuctl up` pins the new one "
        "(`gpuctl down` first if a cluster on it is still up)" if removed else f"no pinned key for {host}")


@app.command("run")
@handled
def run_all(config: ConfigOpt = None, yes: YesOpt = False) -> None:
    """up + train + down in one: the cluster goes away whatever the run's result."""
    from provision import cluster, job
    from provision.providers.base import UpOptions

    cfg = _config(config)
    confirm = (lambda q: True) if yes else (lambda q: typer.confirm(q, default=False, err=True))
    record = cluster.up(cfg, UpOptions(assume_yes=yes, confirm=confirm, say=say))
    code = 1
    try:
        run = job.start_run(cfg, record, say=say)
        code = _follow_to_end(run)
    finally:
        if code != 130:  # detached by Ctrl-C: the run goes on, so does its cluster
            cluster.down(cfg.cluster_name, say)
    raise typer.Exit(code)


image_app = typer.Typer(help="The trainer image: build it here, ship it to docker nodes.", no_args_is_help=True)
app.add_typer(image_app, name="image")
TagOpt = Annotated[Optional[str], typer.Option("--tag", "-t", help="image name (default: provider.image)")]


@image_app.command("build")
@handled
def image_build(config: ConfigOpt = None, tag: TagOpt = None,
                push: Annotated[bool, typer.Option("--push", help="push to the registry after building")] = False,
                ) -> None:
    """docker build the trainer image here (context: docker.context); --push uploads it."""
    from provision import image

    cfg = _config(config)
    name = tag or image.image_name(cfg)
    found = image.build(cfg, name, push=push, say=say)
    say(f"built {name} ({found[:19]}){'; pushed' if push else ''}")


@image_app.command("ship")
@handled
def image_ship(config: ConfigOpt = None, cluster: Annotated[Optional[str], typer.Option(help="cluster name")] = None,
               how: Annotated[Optional[str], typer.Option(
                   "--how", help="pull | load | build | auto (default: docker.ship)")] = None) -> None:
    """Make every node of the cluster have the image; nodes that have it already are skipped."""
    from provision import image, state

    cfg = _config(config)
    record = state.load_cluster(cluster or cfg.cluster_name)
    if record.runtime != "docker":
        say(f"cluster {record.name} runs with runtime {record.runtime}: nothing to ship")
        return
    for result in image.ship_cluster(cfg, record, say, how=how):
        say(f"{result.node}: {result.action} {(result.image_id or '')[:19]}")


from provision import cli_more  # noqa: E402  (registers plan, report, ckpt on app)

cli_more.register(app, handled)


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
