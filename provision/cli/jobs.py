"""Run commands: train, render, status, logs, cancel."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from provision.cli.options import ClusterOpt, ConfigOpt, JsonOpt, RunArg, cluster_name, load, load_if_present, say

if TYPE_CHECKING:
    from provision.core.config import GpuctlConfig
    from provision.core.state import ClusterRecord, RunRecord

app = typer.Typer()
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="show all of job.log (DeepSpeed's INFO lines too)")]


def follow_to_end(
    run: RunRecord, cfg: GpuctlConfig | None = None, *, verbose: bool = False, as_json: bool = False
) -> int:
    """Show the run until it ends (cli/runview.py picks the view); its exit code, or 130 when Ctrl-C detached.
    With the config, a lost cloud node is replaced per its `recovery:` (flows/recover.py)."""
    from provision.cli.runview import show_run
    from provision.core import interrupt
    from provision.flows import job, recover

    def view(run: RunRecord, hook: job.FollowWatch | None = None, reconnect_s: float = 300) -> job.RunStatus:
        return show_run(run, verbose=verbose, as_json=as_json, hook=hook, reconnect_s=reconnect_s)

    try:
        status = view(run) if cfg is None else recover.follow(cfg, run, view, say)
    except KeyboardInterrupt:
        interrupt.answered()  # the detach answers it
        say(f"\ndetached; run {run.run_id} goes on. `gpuctl logs -f` reattaches, `gpuctl cancel` stops it")
        return 130
    from provision.core.errors import RemoteError
    from provision.flows.cluster import after_run

    try:
        results = job.fetch_results(run, say)  # `gpuctl report` works after `down`
    except RemoteError as exc:  # a node that deleted itself right after writing its end
        say(f"warning: the run's result files were not copied ({exc.message}); `gpuctl report` lacks them")
    else:
        from provision.estimate.forecast import results_comparison

        for line in results_comparison(results):
            say(line)
    after_run(cfg, run, say)
    return job.exit_code_of(status)


def _planned_or_recorded(cfg: GpuctlConfig) -> ClusterRecord:
    from provision.core import state
    from provision.flows.cluster import planned

    return state.find_cluster(cfg.cluster_name) or planned(cfg)


@app.command()
def train(
    config: ConfigOpt = None,
    detach: Annotated[bool, typer.Option("--detach", "-d", help="return once the run started")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="render and print, start nothing")] = False,
    resume: Annotated[bool, typer.Option("--resume", help="continue from the store's latest checkpoint")] = False,
    resume_from: Annotated[Optional[str], typer.Option(help="continue from this checkpoint TAG")] = None,
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            help="train even on a node whose checks failed, a config gpuctl plan says does not fit, "
            "or a run predicted not to finish before the budget cap",
        ),
    ] = False,
    verbose: VerboseOpt = False,
    as_json: Annotated[bool, typer.Option("--json", help="stream the metrics as JSON lines")] = False,
) -> None:
    """Run training on the cluster; follow the logs and exit with the run's exit code."""
    from provision.core import state
    from provision.core.config import check_batch, check_storage_for_nodes
    from provision.flows import job
    from provision.flows.cluster import teardown_text
    from provision.providers import backend

    cfg = load(config)
    resume_tag = resume_from or ("latest" if resume else None)
    if dry_run:
        _print_dry_run(cfg, resume_tag)
        return
    check_storage_for_nodes(cfg)  # config errors come first, before any machine is asked
    shape = _planned_or_recorded(cfg)
    if not force:
        from provision.estimate.fit import check_fits

        check_fits(cfg, shape)
    check_batch(cfg.train, shape.world_size)
    cluster = state.load_cluster(cfg.cluster_name)
    if not cluster.creating:  # SSH: the handshake goes on while the checks below and the render run
        from provision.core.errors import GpuctlError
        from provision.transport.remote import warm

        try:
            warm(backend(cluster.provider).nodes(cluster))
        except GpuctlError:  # start_run says it, where it always did
            pass
    if not force:  # `up`'s quick checks (or the last `gpuctl doctor`) found a node that cannot run it
        from provision.flows.doctor import refuse_failed

        refuse_failed(cluster)
    if backend(cluster.provider).terminates_nodes:
        say(teardown_text(cfg))
    from provision.estimate.forecast import say_forecast

    model = say_forecast(cfg, cluster, say)
    if model is not None:  # a resumed run has fewer steps left than max_steps: it is warned, not refused
        from provision.estimate.forecast import check_cap

        check_cap(cfg, cluster, model, say, refuse=not (force or resume_tag))
    run = job.start_run(cfg, cluster, resume=resume_tag, say=say)
    if model is not None:
        from provision.core.state import state_dir
        from provision.estimate.forecast import save_prediction

        save_prediction(state_dir() / "results" / run.run_id, model)
    if detach:
        typer.echo(run.run_id)
        return
    raise typer.Exit(follow_to_end(run, cfg, verbose=verbose, as_json=as_json))


def _print_dry_run(cfg: GpuctlConfig, resume: Optional[str]) -> None:
    """Render into a temp dir and print what would run where."""
    import tempfile

    from provision.flows import job
    from provision.flows.render import render_bundle

    cluster = _planned_or_recorded(cfg)
    spec = job.bundle_spec(cfg, cluster, "dry-run", resume)
    with tempfile.TemporaryDirectory() as tmp:
        out = render_bundle(cfg, spec, Path(tmp))
        typer.echo(f"# would ship to {cluster.name} and run in {spec.run_dir}:")
        for name in ("hostfile", "ds_config.json", "launch.sh"):
            typer.echo(f"--- {name}\n{(out / name).read_text()}")


@app.command()
def render(
    output: Annotated[Path, typer.Option("--output", "-o", help="bundle folder to write")], config: ConfigOpt = None
) -> None:
    """Write the run bundle (hostfile, ds_config.json, launch.sh, ...) without touching a machine."""
    from provision.core.credentials import StorageCredentials
    from provision.flows import job
    from provision.flows.cluster import planned
    from provision.flows.render import render_bundle

    cfg = load(config)
    # No storage credentials in a folder the user keeps: `gpuctl train` hands them over itself.
    spec = job.bundle_spec(cfg, planned(cfg), "rendered", credentials=StorageCredentials())
    spec.run_dir = str(output.resolve())
    render_bundle(cfg, spec, output.resolve())
    say(f"wrote {output}/: hostfile, ds_config.json, launch.sh, .deepspeed_env, run.json, lib/")


@app.command()
def status(
    run_id: RunArg = None, config: ConfigOpt = None, as_json: JsonOpt = False, cluster: ClusterOpt = None
) -> None:
    """Show the cluster and the newest (or given) run."""
    from provision.core import state
    from provision.core.errors import NotFoundError, RemoteError
    from provision.flows import job

    name = cluster if (cluster or run_id) else cluster_name(config, None)
    record = state.find_cluster(name) if name else None
    try:
        run = state.load_run(run_id, None if run_id else name)
        result = job.read_status(run, job.node_of(run)) if state.find_cluster(run.cluster) else None
        for note in result.notes if result else []:
            say(note)
    except NotFoundError:
        run, result = None, None
    except RemoteError as exc:  # e.g. a cloud node that tore itself down (teardown, budget cap)
        say(
            f"warning: cannot reach the node ({exc.message}); showing the last recorded state. "
            "A node that deleted itself is forgotten by `gpuctl down`"
        )
        result = None
        if run is not None and run.state == "running":  # the laptop was away: was the node lost?
            from provision.flows import recover

            run = recover.on_status(run, load_if_present(config), say) or run
            record = state.find_cluster(name) if name else None
    from provision.flows.startup_phases import status_lines

    info = {
        "cluster": state.dump(record) if record else None,
        "run": result.to_json() if result else (state.dump(run) if run else None),
        # the phases before the first step beside `up`'s estimate, once the run wrote summary.json
        "startup": status_lines(run, result.summary) if run and result and result.summary else [],
    }
    if as_json:
        typer.echo(json.dumps(info, indent=2))
        return
    from provision.cli.views import print_status

    print_status(info)


@app.command()
def logs(
    run_id: RunArg = None,
    config: ConfigOpt = None,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="keep following until the run ends")] = False,
    verbose: VerboseOpt = False,
    raw: Annotated[
        bool, typer.Option("--raw", help="the node's bytes as they are, terminal escape sequences included")
    ] = False,
) -> None:
    """Print a run's job.log (terminal escapes scrubbed); -f follows the run in train's view (-v: the whole log),
    also after a dropped connection."""
    from provision.core import state
    from provision.flows import job

    run = state.load_run(run_id, None if run_id else cluster_name(config, None))
    if follow and not raw:
        raise typer.Exit(follow_to_end(run, load_if_present(config), verbose=verbose))
    out = (lambda line: typer.echo(line, color=True)) if raw else typer.echo  # (click strips CSI off a pipe)
    job.follow(run, out, until_end=follow, raw=raw, say=say)


@app.command()
def cancel(run_id: RunArg = None, config: ConfigOpt = None) -> None:
    """Stop a run through the process group launch.sh recorded."""
    from provision.core import state
    from provision.core.errors import RemoteError
    from provision.flows import job

    run = state.load_run(run_id, None if run_id else cluster_name(config, None))
    if not job.cancel(run):
        raise RemoteError(f"run {run.run_id} did not stop", "retry `gpuctl cancel`")
    say(f"run {run.run_id} stopped")
