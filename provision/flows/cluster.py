"""Bring clusters up and down through their provider; local state records what exists."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from provision.core import interrupt, state
from provision.core.config import GpuctlConfig, check_batch, check_storage_for_nodes
from provision.core.errors import GpuctlError, RemoteError, StateError
from provision.flows import job
from provision.providers import backend
from provision.providers.base import ProviderBackend, UpOptions

if TYPE_CHECKING:
    from provision.core.provider_config import CloudProvider

ACTIVE = ("starting", "running")
STOP_GRACE_S = 20.0  # TERM -> KILL for a run's process group in `down`
SELF_TEARDOWN_WAIT_S = 180.0  # a run that ended: how long its rented nodes have to be gone from the vendor's list


def up(cfg: GpuctlConfig, opts: UpOptions) -> state.ClusterRecord | None:
    """Create or connect the cluster; a no-op when it is already up. One `up` at a time per cluster."""
    with state.cluster_lock(cfg.cluster_name, "up"):  # find -> create -> save as one step
        return _up(cfg, opts)


def _up(cfg: GpuctlConfig, opts: UpOptions) -> state.ClusterRecord | None:
    existing = state.find_cluster(cfg.cluster_name)
    if existing is not None and existing.creating:
        # We hold the cluster's lock: the `up` that recorded this is gone (killed before it finished).
        what = "`up` removes what it created first" if opts.dry_run else "removing what it created"
        opts.say(f"an earlier `up` of cluster {existing.name} was stopped before it finished: {what}")
        if not opts.dry_run:
            _down_cluster(existing, opts.say, STOP_GRACE_S)
    elif existing is not None:
        opts.say(f"cluster {existing.name} is already up ({existing.world_size} ranks)")
        return existing
    check_storage_for_nodes(cfg)  # before anything is created: checkpoints that outlive a rented node
    shape = planned(cfg)
    if not opts.force:
        from provision.estimate.fit import check_fits

        check_fits(cfg, shape)
    check_batch(cfg.train, shape.world_size)
    provider = backend(cfg.provider.kind)
    if provider.terminates_nodes:
        opts.say(teardown_text(cfg))
    record = provider.up(cfg, opts)
    if record is None:
        return None
    _finish_up(cfg, record, provider, opts)
    return record


def _finish_up(cfg: GpuctlConfig, record: state.ClusterRecord, provider: ProviderBackend, opts: UpOptions) -> None:
    """Record the cluster, start its guard, ship its image, run the quick checks. Until this returns,
    a failure or a Ctrl-C (SIGTERM, SIGHUP) leaves nothing rented behind; only failing quick checks
    keep the cluster (by design: fix the node and `gpuctl doctor`, or `gpuctl down`)."""
    from provision.core.checks import ChecksFailed

    try:
        check_batch(cfg.train, record.world_size)
        record.creating = False
        state.save_cluster(record)
        if record.budget_hours:
            _start_guard(record, provider, opts)
        opts.say(f"cluster {record.name} is up: {record.world_size} ranks on {len(record.nodes)} node(s)")
        if record.runtime == "docker":  # the image goes out now, not at the first `train`
            from provision.flows.image import ship_cluster

            ship_cluster(cfg, record, opts.say)
        from provision.transport.ssh import client_config as sshconfig

        sshconfig.refresh()
        if sshconfig.ssh_reachable(record):
            opts.say(sshconfig.include_hint(record))
        if opts.doctor:  # before `train` would start: a node that cannot run the job stops here
            _quick_checks(cfg, record, opts)
        interrupt.check()  # a Ctrl-C that a finalizer swallowed on the way still undoes `up`
    except ChecksFailed:
        raise
    except KeyboardInterrupt:
        if not provider.undo_up(record, opts.say):
            opts.say(f"interrupted: cluster {record.name} stays up; `gpuctl down` disconnects it")
        raise
    except BaseException as exc:  # an image that does not pull, a guard that does not start, a bug
        provider.undo_up(record, opts.say, exc)
        raise


def teardown_text(cfg: GpuctlConfig) -> str:
    """What becomes of a rented node when the run ends, for `up` and `train` to say."""
    if cfg.teardown == "after-train":
        return (
            f"teardown after-train: the {cfg.provider.kind} node deletes itself when the run ends, once its final "
            "checkpoint is stored"
        )
    return f"teardown never (gpuctl.yaml): the {cfg.provider.kind} node bills after the run until `gpuctl down`"


def _quick_checks(cfg: GpuctlConfig, record: state.ClusterRecord, opts: UpOptions) -> None:
    from provision.core.checks import ChecksFailed
    from provision.flows.doctor import run_checks

    result = run_checks(cfg, record, quick=True, say=opts.say)
    if result.failing():
        raise ChecksFailed(result, record.name)
    counts = result.counts()
    opts.say(f"quick checks: {counts['pass']} pass, {counts['warn']} warn (`gpuctl doctor` for the table)")
    from provision.estimate.forecast import say_forecast

    current = state.find_cluster(record.name) or record
    model = say_forecast(cfg, current, opts.say)
    if model is not None:  # the cluster is paid for now: `train` refuses a run that cannot finish
        from provision.estimate.forecast import check_cap

        check_cap(cfg, current, model, opts.say, refuse=False)


def _start_guard(record: state.ClusterRecord, provider: ProviderBackend, opts: UpOptions) -> None:
    """The budget cap's guard on the node; a cluster whose cap cannot hold does not stay up."""
    from provision.flows import guard

    nodes = provider.nodes(record)
    try:
        guard.start(record, provider, nodes, opts.say)
    except BaseException:  # Ctrl-C included: _finish_up terminates the unguarded cluster
        opts.say("the budget guard did not start: terminating the new cluster")
        raise
    finally:
        for node in nodes:
            node.close()


def active_runs(cluster: str, say: Callable[[str], None], ends_them: bool) -> list[state.RunRecord]:
    """The cluster's runs that may still go on. A damaged run record of the cluster is passed over
    when terminating the nodes ends whatever it describes (`ends_them`); on your own machines it
    stops `down` (gpuctl cannot tell whether that run still goes on)."""
    runs, damaged = state.scan_runs(cluster)
    for bad in damaged:
        if not ends_them:
            raise bad.error
        say(f"warning: {bad.error.message}; terminating the cluster's nodes ends its run, if any")
    return [r for r in runs if r.state in ACTIVE]


def down(
    name: str,
    say: Callable[[str], None] = print,
    *,
    grace_s: float = STOP_GRACE_S,
    fallback: CloudProvider | None = None,
    confirm: Callable[[str], bool] | None = None,
) -> bool:
    """Stop the cluster's runs, terminate what the provider created, forget the cluster.

    Idempotent: a cluster that is already gone is fine. Returns False when nothing was up.
    A run that does not stop within grace_s does not keep paid nodes alive: a provider that
    terminates its nodes ends it that way (and says so). A damaged record of a rented cluster
    is taken down by what the vendor lists for it (flows/damaged.py; `fallback`: the config's
    provider where the file does not name one, `confirm` asked with the list)."""
    with state.cluster_lock(name, "down"):
        try:
            cluster = state.find_cluster(name)
        except StateError as damage:
            from provision.flows.damaged import down_damaged

            down_damaged(name, damage, say, fallback=fallback, confirm=confirm)
            return True
        return _down(name, cluster, say, grace_s)


def _down(name: str, cluster: state.ClusterRecord | None, say: Callable[[str], None], grace_s: float) -> bool:
    if cluster is None:
        say(f"cluster {name} is not up; nothing to do")
        return False
    try:
        _down_cluster(cluster, say, grace_s)
    except KeyboardInterrupt:
        say(f"interrupted: cluster {name} stays recorded; run `gpuctl down` again to finish removing it")
        raise
    return True


def _down_cluster(cluster: state.ClusterRecord, say: Callable[[str], None], grace_s: float) -> None:
    name = cluster.name
    provider = backend(cluster.provider)
    for run in active_runs(name, say, provider.terminates_nodes):
        say(f"stopping run {run.run_id}")
        try:
            stopped = job.cancel(run, grace_s=grace_s)
        except RemoteError as exc:
            if not provider.terminates_nodes:
                raise
            # A cloud node may have torn itself down already; terminating it ends the run anyway.
            say(f"cannot reach the node of run {run.run_id} ({exc.message}); terminating it ends the run")
            state.update_run(run.run_id, state="lost")
            continue
        if stopped:
            continue
        if not provider.terminates_nodes:  # your own machine: gpuctl will not walk away from a live run
            raise GpuctlError(
                f"run {run.run_id} on {name} did not stop",
                f"retry `gpuctl down`, or stop process group {run.pgid} on the node",
            )
        say(
            f"run {run.run_id} did not stop within {grace_s:.0f}s of TERM and KILL; "
            f"terminating its {cluster.provider} node(s) ends it"
        )
        state.update_run(run.run_id, state="lost")
    provider.down(cluster, say)
    state.delete_cluster(name)
    from provision.transport.ssh import client_config as sshconfig

    sshconfig.refresh()
    say(f"cluster {name} is down")


def after_run(cfg: GpuctlConfig | None, run: state.RunRecord, say: Callable[[str], None]) -> None:
    """A followed run on rented nodes ended: say whether they are gone or still billing. Nodes that deleted
    themselves (teardown after-train) are checked against the vendor's own list, and their cluster is then
    forgotten with what `up` made beside them (AWS: its security group and key pair): no `gpuctl down`."""
    from provision.providers.cloud import CloudBackend

    cluster = state.find_cluster(run.cluster)
    provider = backend(cluster.provider) if cluster else None
    if cluster is None or not isinstance(provider, CloudBackend):
        return
    kind, price = cluster.provider, f"${cluster.price_per_hour:.3f}/h" if cluster.price_per_hour else "by the hour"
    if cfg is None or cfg.cluster_name != cluster.name or cfg.teardown != "after-train":
        say(f"node: the {kind} cluster {cluster.name} is still up and billing {price}: `gpuctl down` deletes it")
        return
    ids = [n.instance_id for n in cluster.nodes if n.instance_id]
    try:
        provider.wait_gone(cluster, ids, timeout_s=SELF_TEARDOWN_WAIT_S)
    except GpuctlError:
        say(
            f"node: {kind} still lists instance(s) {', '.join(ids)} {SELF_TEARDOWN_WAIT_S:.0f} s after the run "
            f"ended, so it may still be billing {price}: `gpuctl down` terminates it"
        )
        return
    with state.cluster_lock(cluster.name, "down"):
        provider.release(cluster, say)
        provider.forget_local(cluster)
        state.delete_cluster(cluster.name)
    from provision.transport.ssh import client_config as sshconfig

    sshconfig.refresh()
    say(
        f"node: gone; {kind} instance(s) {', '.join(ids)} deleted themselves after the run (teardown after-train), "
        "billing stopped"
    )


def planned(cfg: GpuctlConfig) -> state.ClusterRecord:
    """The cluster `up` would record, without touching a machine (for render and dry runs)."""
    from provision.core.provider_config import LocalProvider, SlurmProvider, SSHProvider
    from provision.providers.base import resolve_runtime
    from provision.providers.local import node_python, visible_gpus

    prov = cfg.provider
    if isinstance(prov, SlurmProvider):
        from provision.providers.slurm import planned as slurm_planned

        return slurm_planned(cfg)
    if isinstance(prov, LocalProvider):
        gpus = visible_gpus()
        slots = prov.gpus_per_node or len(gpus) or prov.cpu_ranks
        accel = "cuda" if (prov.gpus_per_node or gpus) else "cpu"
        node = state.NodeRecord(
            host="localhost",
            slots=slots,
            accelerator=accel,
            gpu_name=gpus[0] if gpus else None,
            workdir=str(state.state_dir() / "local-node"),
        )
        return state.ClusterRecord(name=cfg.cluster_name, provider="local", nodes=[node], python=node_python(prov))
    if isinstance(prov, SSHProvider):
        from provision.providers.ssh_hosts import hostfile_names, targets

        found = targets(prov)
        home = "/root" if found[0].user == "root" else f"/home/{found[0].user}"  # a guess; `up` asks the node
        workdir = (prov.workdir or "gpuctl").replace("~/", "", 1)
        workdir = workdir if workdir.startswith("/") else f"{home}/{workdir}"  # one path on every node
        nodes = [
            state.NodeRecord(
                host=name,
                address=t.address,
                port=t.port,
                user=t.user,
                slots=prov.gpus_per_node or prov.cpu_ranks,
                accelerator="cuda" if prov.gpus_per_node else "cpu",
                workdir=workdir,
            )
            for t, name in zip(found, hostfile_names(found), strict=True)
        ]
        docker = prov.runtime == "docker"  # auto depends on the node; `up` decides
        return state.ClusterRecord(
            name=cfg.cluster_name,
            provider="ssh",
            nodes=nodes,
            python=prov.python,
            runtime="docker" if docker else "none",
            image=prov.image if docker else None,
        )
    from provision.providers.bootstrap import venv_python
    from provision.providers.vendor_images import BOOTSTRAP_IMAGES, boot_image

    runtime = resolve_runtime(prov.runtime, prov.kind, image=prov.image)
    nodes = [
        state.NodeRecord(
            host=f"node{i}", slots=prov.gpus_per_node, accelerator="cuda", gpu_name=prov.gpu, workdir="/root/gpuctl"
        )
        for i in range(prov.nodes)
    ]
    return state.ClusterRecord(
        name=cfg.cluster_name,
        provider=prov.kind,
        nodes=nodes,
        python=venv_python("/root/gpuctl") if runtime == "bootstrap" else prov.python,
        image=boot_image(prov, prov.kind) if prov.kind in BOOTSTRAP_IMAGES else prov.image,
        runtime=runtime,
    )
