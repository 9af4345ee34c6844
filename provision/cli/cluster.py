"""Cluster commands: init, up, offers, down, sweep, ssh, forget-host, run (up + train + down)."""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from provision.cli.options import (
    ClusterOpt,
    ConfigOpt,
    JsonOpt,
    YesOpt,
    cluster_name,
    confirmer,
    load,
    load_if_present,
    say,
)

if TYPE_CHECKING:
    from provision.core.provider_config import CloudProvider

app = typer.Typer()


class Kind(str, Enum):
    local = "local"
    ssh = "ssh"
    vast = "vast"
    runpod = "runpod"
    aws = "aws"


@app.command()
def init(
    path: Annotated[Path, typer.Argument(help="where to write")] = Path("gpuctl.yaml"),
    provider: Annotated[Kind, typer.Option(help="where the nodes come from")] = Kind.local,
    storage: Annotated[
        Optional[str], typer.Option(help="storage.url, e.g. s3://my-bucket/gpuctl (default: a placeholder to set)")
    ] = None,
    force: Annotated[bool, typer.Option(help="overwrite an existing file")] = False,
) -> None:
    """Write a gpuctl.yaml for the provider with every field present and commented (vast, runpod, aws: the
    DeepSeek-7B target run, a budget cap, teardown after the run)."""
    from provision.core.config import STORAGE_PLACEHOLDER
    from provision.flows.init_config import config_text, write

    write(path, provider.value, storage, force=force)
    if STORAGE_PLACEHOLDER in config_text(provider.value, storage):
        say(f"wrote {path}; next: set storage.url to your bucket, then gpuctl offers, gpuctl up, gpuctl train")
    else:
        say(f"wrote {path}; next: gpuctl up && gpuctl train")


@app.command()
def up(
    config: ConfigOpt = None,
    yes: YesOpt = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="show what would be created")] = False,
    skip_doctor: Annotated[bool, typer.Option("--skip-doctor", help="do not run the quick node checks")] = False,
    force: Annotated[
        bool, typer.Option("--force", help="rent even when gpuctl plan says the config does not fit")
    ] = False,
) -> None:
    """Create (cloud) or connect (local, ssh) the cluster, record it and run the quick node checks."""
    from provision.core.checks import ChecksFailed
    from provision.flows import cluster
    from provision.providers.base import UpOptions

    opts = UpOptions(
        dry_run=dry_run, assume_yes=yes, confirm=confirmer(yes), say=say, doctor=not skip_doctor, force=force
    )
    try:
        cluster.up(load(config), opts)
    except ChecksFailed as exc:
        from provision.cli.doctor_view import print_checks

        print_checks(exc.result, only_failing=True)
        raise


@app.command()
def offers(
    config: ConfigOpt = None, as_json: JsonOpt = False, limit: Annotated[int, typer.Option(help="rows to show")] = 15
) -> None:
    """List the rentable machines that match the config's cloud provider, cheapest first."""
    from dataclasses import asdict

    from provision.core.errors import ConfigError
    from provision.core.provider_config import CloudProvider
    from provision.providers import backend

    cfg = load(config)
    provider = backend(cfg.provider.kind)
    if provider.offers is None or not isinstance(cfg.provider, CloudProvider):
        raise ConfigError(f"provider {cfg.provider.kind} rents nothing", "offers are for vast, runpod and aws")
    from provision.estimate.sizing import sized_provider, sizing_note

    prov = sized_provider(cfg)  # min_ram_gb / disk_gb from plan's node figures unless set
    say(sizing_note(cfg, prov))  # why an offer with less is not listed
    rows = provider.offers.find_offers(prov)[:limit]
    if as_json:
        typer.echo(json.dumps([asdict(o) for o in rows], indent=2))
        return
    from provision.cli.views import print_offers

    print_offers(rows, f"{cfg.provider.kind} offers {provider.offers.filters_text(prov)}")


@app.command()
def down(config: ConfigOpt = None, yes: YesOpt = False, cluster: ClusterOpt = None) -> None:
    """Stop the cluster's runs and terminate or disconnect its machines."""
    from provision.core import state
    from provision.core.errors import StateError
    from provision.flows import cluster as clusters
    from provision.providers import backend

    name = cluster_name(config, cluster)
    try:
        record = state.find_cluster(name)
    except StateError:  # damaged: `down` asks the vendor what runs for it, and asks with that list
        clusters.down(name, say, fallback=_rented_provider(config, name), confirm=confirmer(yes))
        return
    if record and backend(record.provider).terminates_nodes and not yes:
        if not confirmer(False)(f"terminate {len(record.nodes)} {record.provider} node(s) of {name}?"):
            raise typer.Exit(1)
    clusters.down(name, say)


@app.command()
def sweep(
    config: ConfigOpt = None,
    yes: YesOpt = False,
    as_json: JsonOpt = False,
    provider: Annotated[
        Optional[list[str]], typer.Option("--provider", help="look at this vendor only (vast, runpod, aws; repeatable)")
    ] = None,
) -> None:
    """Find instances labelled as gpuctl's that no cluster record owns, on every configured vendor
    account, with their $/h; offer to terminate them (--yes: without asking; --json: list them)."""
    from provision.cli.options import load_if_present
    from provision.core.errors import ConfigError, ProviderError
    from provision.flows import sweep as sweeping

    unknown = sorted(set(provider or []) - set(sweeping.KINDS))
    if unknown:
        raise ConfigError(f"--provider {unknown[0]} is not one of {', '.join(sweeping.KINDS)}", "fix --provider")
    found = sweeping.find(load_if_present(config), provider)
    if not as_json:
        from provision.cli.views import print_sweep

        print_sweep(found)
    terminated: list[str] = []
    question = f"terminate {len(found.strays)} instance(s) (${found.price_per_hour:.3f}/h)?"
    if found.strays and (yes or (not as_json and confirmer(False)(question))):
        terminated = sweeping.terminate(found, say)
    if as_json:
        doc = {
            "checked": found.checked,
            "strays": [s.to_json() for s in found.strays],
            "price_per_hour": round(found.price_per_hour, 4),
            "terminated": terminated,
            "skipped": found.skipped,
            "errors": found.errors,
        }
        typer.echo(json.dumps(doc, indent=2))
    if found.errors:
        raise ProviderError(f"sweep: {found.errors[0]}", "fix that account's credentials or endpoint, then rerun")
    if found.strays and not yes and not terminated and not as_json:
        say("nothing terminated")
        raise typer.Exit(1)


def _rented_provider(config: Optional[Path], name: str) -> CloudProvider | None:
    """The config's cloud provider when the config is cluster `name`'s (a broken config: None)."""
    from provision.core.errors import ConfigError
    from provision.core.provider_config import CloudProvider

    try:
        cfg = load_if_present(config)
    except ConfigError:
        return None
    if cfg is None or cfg.cluster_name != name or not isinstance(cfg.provider, CloudProvider):
        return None
    return cfg.provider


@app.command(context_settings={"allow_interspersed_args": False})
def ssh(
    command: Annotated[
        Optional[list[str]],
        typer.Argument(
            help="one argument: a shell command line; several: a command and its arguments, passed verbatim; "
            "none: a login shell"
        ),
    ] = None,
    node: Annotated[int, typer.Option("--node", "-n", help="node index (0 = first)")] = 0,
    config: ConfigOpt = None,
    cluster: ClusterOpt = None,
) -> None:
    """Open a shell (or run a command) on a node, checking the host key gpuctl pinned."""
    import subprocess

    from provision.transport.ssh.client_config import ssh_argv

    raise typer.Exit(subprocess.call(ssh_argv(cluster_name(config, cluster), node, command or [])))


@app.command("forget-host")
def forget_host(host: Annotated[str, typer.Argument(help="host, host:port or user@host:port")]) -> None:
    """Forget a host's pinned SSH key (after the machine was really reinstalled)."""
    from provision.transport.ssh.node import forget_host as forget

    removed = forget(host)
    say(
        f"forgot {removed} pinned key(s) of {host}; the next `gpuctl up` pins the new one "
        "(`gpuctl down` first if a cluster on it is still up)"
        if removed
        else f"no pinned key for {host}"
    )


@app.command("run")
def run_all(config: ConfigOpt = None, yes: YesOpt = False) -> None:
    """up + train + down in one: the cluster goes away whatever the run's result, a failed `up` included."""
    from provision.cli.jobs import follow_to_end
    from provision.core import interrupt
    from provision.core.checks import ChecksFailed
    from provision.core.errors import ClusterBusy
    from provision.flows import cluster, job
    from provision.providers.base import UpOptions

    cfg = load(config)
    try:
        record = cluster.up(cfg, UpOptions(assume_yes=yes, confirm=confirmer(yes), say=say))
    except ChecksFailed as exc:  # `run` promises the cluster goes away: a node that cannot train included
        from provision.cli.doctor_view import print_checks

        print_checks(exc.result, only_failing=True)
        _down_after_failure(cfg.cluster_name)
        raise
    except (KeyboardInterrupt, ClusterBusy):  # up answered it / another gpuctl's cluster: not ours to take
        raise
    except BaseException:  # up terminated what it created; whatever it left recorded goes too
        _down_after_failure(cfg.cluster_name)
        raise
    assert record is not None  # up returns None only on a dry run
    code = 1
    try:
        run = job.start_run(cfg, record, say=say)
        code = follow_to_end(run, cfg)
    except KeyboardInterrupt:  # before the run was followed: the `down` below answers it
        interrupt.answered()  # (a further Ctrl-C stops that `down`; the cluster stays recorded)
        say(f"interrupted before the run was followed: taking cluster {cfg.cluster_name} down")
        raise
    finally:
        if code != 130:  # detached by Ctrl-C: the run goes on, so does its cluster
            cluster.down(cfg.cluster_name, say)
    raise typer.Exit(code)


def _down_after_failure(name: str) -> None:
    """`run` failed before its run started: down the cluster if it is recorded. A `down` that fails
    too is one more line; the first failure is the one `run` exits with."""
    from provision.core import state
    from provision.core.errors import GpuctlError
    from provision.flows import cluster

    try:
        if state.find_cluster(name) is not None:
            cluster.down(name, say)
    except GpuctlError as exc:
        say(f"error: could not take cluster {name} down: {exc.one_line()}; run `gpuctl down`")
