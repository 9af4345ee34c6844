"""A lost node of a multi-node cloud cluster: replace that node only (flows/recover.py).

The surviving nodes keep their instances. The run's processes on them are stopped and their copy
of the run dir removed (the run starts again under the same id with --resume, and a stale
status.json would read as the new run's end); the lost instance is terminated (verified gone),
the cheapest fitting offer not on a lost host is rented at the lost node's place in the hostfile
(same world size), the cluster key mesh is set up again across all nodes and, with a budget cap,
the guard restarted with the new instance list. The caller ships and starts the run.

None when no replacement can be had (no offer, a node that does not boot): the caller then
replaces the whole cluster, as for a single node.
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable

from provision.core import state
from provision.core.config import GpuctlConfig
from provision.core.errors import GpuctlError, RemoteError
from provision.core.provider_config import CloudProvider
from provision.providers.cloud import CloudBackend, describe_offer
from provision.providers.labels import new_labels
from provision.providers.prices import cluster_cap

# Kill every process whose working directory is the run dir: the ranks a lost peer left behind
# (pdsh started them from the first node; with that node gone nothing else owns them).
KILL_BY_CWD = (
    'for p in /proc/[0-9]*; do [ "$(readlink "$p/cwd" 2>/dev/null)" = "$1" ] && kill -9 "${p#/proc/}" '
    '2>/dev/null; done; rm -rf -- "$1"'
)


def lost_indices(provider: CloudBackend, cluster: state.ClusterRecord) -> list[int]:
    """The nodes whose instance the vendor reports failed or no longer lists."""
    lost = []
    for i, node in enumerate(cluster.nodes):
        if node.instance_id:
            inst = provider.describe(cluster, node.instance_id)
            if inst is None or inst.failed:
                lost.append(i)
    return lost


def replace_lost_nodes(
    cfg: GpuctlConfig,
    run: state.RunRecord,
    cluster: state.ClusterRecord,
    lost: list[int],
    exclude: set[str],
    say: Callable[[str], None],
) -> state.ClusterRecord | None:
    """Replace the nodes at `lost` in place; the updated cluster record, or None (see the module doc)."""
    from provision.estimate.sizing import sized_provider

    provider = _cloud(cluster)
    prov = sized_provider(cfg)
    try:
        _stop_survivors(provider, run, cluster, lost, say)
    except GpuctlError as exc:  # a survivor that does not answer either: the whole cluster goes
        say(f"{exc.message}: replacing the whole cluster")
        return None
    gone = [cluster.nodes[i].instance_id or "" for i in lost]
    for instance_id in gone:
        provider.terminate(cluster, instance_id)
    provider.wait_gone(cluster, gone)
    old_price = sum(cluster.nodes[i].price_per_hour or 0.0 for i in lost)
    _forget_lost(cluster, lost)
    offers = [o for o in provider.find_offers(prov) if not (o.host and o.host in exclude)]
    if len(offers) < 1:
        say(f"no {provider.kind} offer for a replacement node: replacing the whole cluster")
        return None
    record = cluster.model_copy(deep=True)
    created: list[str] = []
    labels = new_labels(record.name, lost)
    _private, public_key = _keypair(record.name)
    try:
        for i, label in zip(lost, labels, strict=True):
            pick = provider.picks(offers, 1)[0]
            say(f"replacing node {i}: {describe_offer(pick)}")
            node = record.nodes[i]
            node.instance_id, node.label, node.address = None, label, ""
            state.save_cluster(record)  # the intent: `gpuctl down` finds the create by its label if this dies
            instance_id = provider.launch(prov, record, label, pick, public_key)
            created.append(instance_id)
            node.instance_id, node.host_id = instance_id, pick.host or None
            node.slots, node.gpu_name, node.price_per_hour = pick.num_gpus, pick.gpu_name, pick.price_per_hour
            state.save_cluster(record)  # the id, as soon as the vendor answered
            provider.attach(record, instance_id, public_key)
            deadline = time.monotonic() + prov.ready_timeout
            provider.wait_ready(prov, record, node, deadline, say)
            provider.check_not_excluded(record, node, exclude)
            offers = [o for o in offers if o.id != pick.id or not o.host]  # one machine per offer (vast)
        if record.world_size != cluster.world_size:
            raise GpuctlError(f"the replacement has {record.world_size} ranks, the run {cluster.world_size}")
        new_price = sum(record.nodes[i].price_per_hour or 0.0 for i in lost)  # billed, once booted (wait_ready)
        _rejoin(provider, cfg, record, cluster, old_price, new_price, say)
    except (GpuctlError, RemoteError) as exc:
        say(f"replacing node(s) {', '.join(map(str, lost))} failed ({exc}): replacing the whole cluster")
        for instance_id in created:  # only this attempt's; the survivors stay for the whole-cluster path
            provider.terminate(record, instance_id)
        provider.wait_gone(record, created)
        return None
    return record


def _cloud(cluster: state.ClusterRecord) -> CloudBackend:
    from provision.providers import backend

    provider = backend(cluster.provider)
    assert isinstance(provider, CloudBackend)  # recovery follows cloud clusters only
    return provider


def _keypair(name: str) -> tuple[str, str]:
    from provision.transport.ssh import mesh

    return mesh.cluster_keypair(name)


def _stop_survivors(
    provider: CloudBackend,
    run: state.RunRecord,
    cluster: state.ClusterRecord,
    lost: list[int],
    say: Callable[[str], None],
) -> None:
    """End the run's processes on the nodes that stay and remove their run dir (same run id next)."""
    from provision.flows import job
    from provision.flows.docker import remove_container

    run_dir = job.run_dir_of(cluster.nodes[0].workdir, run.run_id)
    for i, rec in enumerate(cluster.nodes):
        if i in lost:
            continue
        node = provider.ssh_node(cluster, rec)
        try:
            if i == 0 and run.pgid and node.group_alive(run.pgid):
                node.signal_group(run.pgid, "KILL")  # the launcher; its pdsh sessions end with it
            remove_container(run, node)
            node.sh(KILL_BY_CWD, job.run_dir_of(rec.workdir, run.run_id), timeout=120)
        except RemoteError as exc:
            raise GpuctlError(f"node {rec.host} of the cluster does not answer: {exc.message}") from exc
        finally:
            node.close()
    say(f"stopped run {run.run_id} on the surviving node(s) and cleared {shlex.quote(run_dir)}")


def _forget_lost(cluster: state.ClusterRecord, lost: list[int]) -> None:
    """Cloud addresses are reused: drop the lost nodes' pinned host keys."""
    from provision.transport.ssh.node import forget_host

    for i in lost:
        node = cluster.nodes[i]
        if node.address:
            forget_host(f"{node.address}:{node.port}")


def _rejoin(
    provider: CloudBackend,
    cfg: GpuctlConfig,
    record: state.ClusterRecord,
    old: state.ClusterRecord,
    old_price: float,
    new_price: float,
    say: Callable[[str], None],
) -> None:
    """The new node joins: key mesh across all nodes, the cluster's price and cap, the guard."""
    from provision.transport.ssh import mesh

    prov = cfg.provider
    assert isinstance(prov, CloudProvider)
    nodes = provider.nodes(record)
    try:
        mesh.setup(record, nodes, say=say)
    finally:
        for node in nodes:
            node.close()
    now = time.time()
    hours = (now - old.created_at) / 3600  # what the old set of nodes cost, carried as spent
    record.spent_hours = old.spent_hours + hours
    record.spent_cost = old.spent_cost + hours * (old.price_per_hour or 0.0)
    if old.price_per_hour is not None:
        record.price_per_hour = round(old.price_per_hour - old_price + new_price, 4)
    record.created_at = now
    record.budget_hours = cluster_cap(prov, record)
    state.save_cluster(record)
    if record.budget_hours:
        from provision.flows import guard

        nodes = provider.nodes(record)
        try:  # the guards again, with the new instance list and cap (guard.start stops the old ones first)
            guard.start(record, provider, nodes, say)
        finally:
            for node in nodes:
                node.close()
