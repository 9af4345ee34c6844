"""A node lost mid-run (a preempted spot/bid instance, a host that vanished): find out, and
finish the run anyway on a new node.

Lost means the vendor says so: the instance is exited/stopped/offline or no longer listed, or
the node stayed unreachable past recovery.lost_after while the vendor still answers. A slow
step (the node answers) or a dropped laptop link (the vendor does not answer either) is never
a loss: the follow just reconnects.

Recovery: terminate what is left (verified, as `down` does), rent the next fitting offer (not
the lost host), bring it up, ship, and start the same run id with --resume from the newest
complete checkpoint in storage; metrics.jsonl continues (the laptop keeps a copy while it
follows, and seeds the new node with it up to the resumed step). Each restart is an event in
the run record. Restarts stop at recovery.max_restarts and at the budget cap, which counts
what every earlier cluster of the run cost.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn, Protocol

from provision.core import interrupt, state
from provision.core.config import GpuctlConfig
from provision.core.errors import GpuctlError, ProviderError, RemoteError
from provision.core.provider_config import CloudProvider
from provision.flows import job
from provision.providers import backend
from provision.providers.base import UpOptions
from provision.providers.cloud import CloudBackend
from provision.transport.remote import Node

VENDOR_LOOK_S = 15.0  # how often a followed multi-node run asks the vendor about its other nodes
LOST_HOST_RETRIES = 3  # a vendor that places nodes itself (runpod) put one on a lost host: ask again


class NodeLost(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def cloud_of(cluster: state.ClusterRecord) -> CloudBackend | None:
    provider = backend(cluster.provider)
    return provider if isinstance(provider, CloudBackend) else None


@dataclass
class Verdict:
    """What the vendor says about a cluster's instances."""

    reason: str | None = None  # what is wrong with a node; None: nothing
    answered: bool = False  # False: the vendor could not be asked (the laptop is offline?)
    gone: bool = False  # an instance is no longer listed (which a node that ends itself also causes)


def vendor_trouble(cluster: state.ClusterRecord) -> Verdict:
    provider = cloud_of(cluster)
    if provider is None:
        return Verdict()
    for node in cluster.nodes:
        if not node.instance_id:
            continue
        try:
            inst = provider.describe(cluster, node.instance_id)
        except (ProviderError, RemoteError, OSError):
            return Verdict()  # the laptop cannot reach the vendor either: nothing to conclude
        if inst is None:
            return Verdict(f"{cluster.provider} instance {node.instance_id} is gone (no longer listed)", True, True)
        if inst.failed:
            return Verdict(
                f"{cluster.provider} instance {node.instance_id} was preempted or stopped ({inst.state})", True
            )
    return Verdict(answered=True)


def at_cap(cluster: state.ClusterRecord) -> bool:
    """The cluster's budget cap has come: its guard deletes the nodes then (flows/guard.py)."""
    cap = cluster.budget_hours
    return cap is not None and time.time() >= cluster.created_at + cap * 3600 - 60


def metrics_copy(run: state.RunRecord) -> Path:
    return state.state_dir() / "results" / run.run_id / "metrics.jsonl"


@dataclass
class LossWatch:
    """job.follow's FollowWatch: keeps a copy of metrics.jsonl and decides when the node is lost."""

    run: state.RunRecord
    cluster: state.ClusterRecord
    lost_after: float
    offset: int = 0
    next_vendor_look: float = 0.0

    def __post_init__(self) -> None:
        copy = metrics_copy(self.run)
        self.offset = copy.stat().st_size if copy.is_file() else 0

    def seen(self, node: Node) -> None:
        # At every poll: a step's line is written well before its checkpoint is complete in the
        # store, so the copy holds every step up to the one a new node resumes from.
        chunk, self.offset = node.read_new(f"{self.run.run_dir}/metrics.jsonl", self.offset)
        if chunk:
            copy = metrics_copy(self.run)
            copy.parent.mkdir(parents=True, exist_ok=True)
            with copy.open("a") as handle:
                handle.write(chunk)
        if len(self.cluster.nodes) > 1 and time.monotonic() >= self.next_vendor_look:
            # The followed (first) node answers, but another may be gone: its peers then hang in a
            # collective until their timeout. Ask the vendor now and then.
            self.next_vendor_look = time.monotonic() + VENDOR_LOOK_S
            verdict = vendor_trouble(self.cluster)
            if verdict.reason and not (verdict.gone and at_cap(self.cluster)):
                raise NodeLost(verdict.reason)

    def unreachable(self, seconds: float, error: RemoteError) -> None:
        verdict = vendor_trouble(self.cluster)
        if verdict.reason and not (verdict.gone and at_cap(self.cluster)):  # the guard deleted it at the cap
            raise NodeLost(verdict.reason)
        if verdict.answered and seconds > self.lost_after:
            raise NodeLost(
                f"unreachable for {seconds:.0f}s ({error.message}) while {self.cluster.provider} says it runs"
            )


class View(Protocol):
    """How the run is shown while followed (cli/runview.py): to its end, with `hook` told of each
    read and each failed one, reconnecting for up to reconnect_s."""

    def __call__(
        self, run: state.RunRecord, hook: job.FollowWatch | None = ..., reconnect_s: float = ...
    ) -> job.RunStatus: ...


def follow(cfg: GpuctlConfig, run: state.RunRecord, view: View, say: Callable[[str], None]) -> job.RunStatus:
    """Follow the run until it ends; a lost node is replaced (or the run given up) on the way."""
    while True:
        cluster = state.find_cluster(run.cluster)
        if cluster is None or cloud_of(cluster) is None:
            return view(run)
        watch = LossWatch(run, cluster, cfg.recovery.lost_after)
        try:
            status = view(run, watch, max(300.0, cfg.recovery.lost_after + 60))
        except NodeLost as lost:
            reason = lost.reason
        else:
            if status.state not in ("lost", "failed"):  # a lost peer node can fail the ranks that remain
                return status
            found = vendor_trouble(cluster)  # the run died: with its node, or alone?
            if found.reason is None or (found.gone and (at_cap(cluster) or cfg.teardown == "after-train")):
                return status  # alone (a node that deleted itself after the run or at its cap is no loss)
            reason = found.reason
        run = recover(cfg, run, reason, say)


def _spent(cluster: state.ClusterRecord) -> tuple[float, float]:
    """(hours, $) the run's clusters have cost so far, this one included."""
    hours = (time.time() - cluster.created_at) / 3600
    return cluster.spent_hours + hours, cluster.spent_cost + hours * (cluster.price_per_hour or 0.0)


def restarts_allowed(cfg: GpuctlConfig) -> int:
    prov = cfg.provider
    return cfg.recovery.restarts_allowed(bool(getattr(prov, "interruptible", False)))


def resume_hint() -> str:
    return "`gpuctl up --yes && gpuctl train --resume` resumes it from the newest complete checkpoint"


def recover(cfg: GpuctlConfig, run: state.RunRecord, reason: str, say: Callable[[str], None]) -> state.RunRecord:
    """Replace the lost cluster and start the run again from its newest complete checkpoint."""
    from provision.flows import cluster as cluster_flow

    old = state.load_cluster(run.cluster)
    run = state.load_run(run.run_id)
    say(f"node lost: {reason}")
    allowed = restarts_allowed(cfg)
    if len(run.restarts) >= allowed:
        give_up(run, f"{reason}; {len(run.restarts)} of {allowed} restart(s) used (recovery.max_restarts)", say)
    hours, cost = _spent(old)
    prov = cfg.provider
    assert isinstance(prov, CloudProvider)  # recovery follows cloud clusters only
    if (prov.max_hours and hours >= prov.max_hours) or (prov.max_cost and cost >= prov.max_cost):
        give_up(run, f"{reason}; the budget cap is spent ({hours:.2f} h, ${cost:.2f})", say)
    old_ids = ",".join(n.instance_id or "?" for n in old.nodes)
    try:
        named = _named_lost(old)  # several nodes: the ones the vendor says are lost ([]: all of them)
        lost_hosts = {n.host_id for n in ([old.nodes[i] for i in named] or old.nodes) if n.host_id}
        lost_hosts |= {host for e in run.restarts for host in e.old_host.split(",") if host}
        exclude = lost_hosts if cfg.recovery.exclude_lost_hosts else set()
        new = _replace_nodes(cfg, run, old, named, exclude, say) if named else None
        if new is None:
            say(f"restart {len(run.restarts) + 1} of {allowed}: terminating {old_ids}, renting another cluster")
            cluster_flow.down(old.name, say)
            new = _up_again(
                cfg,
                UpOptions(
                    assume_yes=True, force=True, say=say, exclude_hosts=exclude, spent_hours=hours, spent_cost=cost
                ),
            )
        tag, step, stored = _newest_checkpoint(cfg, say)
        seed = _metrics_upto(run, step, stored)
        started = job.start_run(cfg, new, resume=tag, say=say, run_id=run.run_id, seed_files={"metrics.jsonl": seed})
    except KeyboardInterrupt:
        interrupt.answered()  # answered here: a run that is not going must not read as "detached"
        give_up(run, f"{reason}; recovery interrupted", say)
    except GpuctlError as exc:  # no offer left, a node that did not boot, the store unreachable
        give_up(run, f"{reason}; recovery failed: {exc.message}", say)
    kept = {n.instance_id for n in new.nodes} & {n.instance_id for n in old.nodes}  # nodes replaced alone
    gone = [n for n in old.nodes if n.instance_id not in kept]
    event = state.RestartEvent(
        at=time.time(),
        reason=reason,
        old_instance=",".join(n.instance_id or "?" for n in gone),
        old_host=",".join(sorted(n.host_id for n in gone if n.host_id)),
        new_instance=",".join(n.instance_id or "?" for n in new.nodes if n.instance_id not in kept),
        resumed_from=tag,
        step=step,
        cost_so_far=round(cost, 4),
    )
    say(f"run {run.run_id} resumed on {event.new_instance} from {tag or 'the start'} (step {step})")
    return state.update_run(started.run_id, restarts=[*run.restarts, event], created_at=run.created_at)


def _named_lost(old: state.ClusterRecord) -> list[int]:
    """The nodes of a multi-node cluster its vendor reports lost; [] for one node, or when all are."""
    from provision.flows import replace_node

    provider = cloud_of(old)
    if provider is None or len(old.nodes) < 2:
        return []
    lost = replace_node.lost_indices(provider, old)
    return lost if len(lost) < len(old.nodes) else []


def _replace_nodes(
    cfg: GpuctlConfig,
    run: state.RunRecord,
    old: state.ClusterRecord,
    lost: list[int],
    exclude: set[str],
    say: Callable[[str], None],
) -> state.ClusterRecord | None:
    """Replace the lost nodes only (flows/replace_node.py); None: the whole cluster goes instead."""
    from provision.flows import replace_node

    names = ", ".join(f"{old.nodes[i].host} ({old.nodes[i].instance_id})" for i in lost)
    say(f"replacing lost node(s) {names}; the other {len(old.nodes) - len(lost)} keep their instances")
    return replace_node.replace_lost_nodes(cfg, run, old, lost, exclude, say)


def _up_again(cfg: GpuctlConfig, opts: UpOptions) -> state.ClusterRecord:
    """A new cluster for the run; a vendor that placed a node on a lost host is asked again."""
    from provision.flows import cluster as cluster_flow
    from provision.providers.cloud import LostHostAgain

    for attempt in range(LOST_HOST_RETRIES):
        try:
            new = cluster_flow.up(cfg, opts)  # a failed or interrupted up leaves nothing rented
            assert new is not None  # not a dry run
            return new
        except LostHostAgain as exc:
            if attempt + 1 == LOST_HOST_RETRIES:
                raise
            opts.say(f"{exc.message}: asking again")
    raise AssertionError("unreachable")


def give_up(run: state.RunRecord, what: str, say: Callable[[str], None]) -> NoReturn:
    """No new node for the run (no restart left, budget spent, recovery failed): the run is lost,
    nothing stays rented for it, and one line names the command that resumes it."""
    from provision.flows import cluster as cluster_flow

    state.update_run(run.run_id, state="lost")
    if state.find_cluster(run.cluster) is not None:
        cluster_flow.down(run.cluster, say)
    raise GpuctlError(f"run {run.run_id} lost: {what}", resume_hint())


def _newest_checkpoint(cfg: GpuctlConfig, say: Callable[[str], None]) -> tuple[str | None, int, str]:
    """The store's newest complete checkpoint: ("latest", its step, the metrics.jsonl lines it
    carries), or (None, 0, "") with none yet."""
    from trainer.objstore.store import CheckpointStore

    store = CheckpointStore.from_config(cfg.storage_settings(), log=say)
    info = store.latest()
    if info is None:
        return None, 0, ""
    stored = store.backend.read_bytes(f"{info.tag}/metrics.jsonl")  # trainer/checkpoint.py saves a copy
    return "latest", info.step, stored.decode(errors="replace") if stored else ""


def _metrics_upto(run: state.RunRecord, step: int, stored: str) -> str:
    """metrics.jsonl up to the resumed step, for the new node to append to: the laptop's copy (kept
    while it followed) and the checkpoint's (the steps logged while no laptop followed), by step."""
    copy = metrics_copy(run)
    rows: dict[int, str] = {}
    for line in [*stored.splitlines(), *(copy.read_text().splitlines() if copy.is_file() else [])]:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short when the node was lost
        if isinstance(row, dict) and isinstance(row.get("step"), int) and 0 < row["step"] <= step:
            rows.setdefault(row["step"], line.strip() + "\n")
    text = "".join(rows[s] for s in sorted(rows))
    copy.parent.mkdir(parents=True, exist_ok=True)
    copy.write_text(text)
    return text


def on_status(run: state.RunRecord, cfg: GpuctlConfig | None, say: Callable[[str], None]) -> state.RunRecord | None:
    """`gpuctl status` could not reach a running run's node: ask the vendor what happened.

    Lost and recovery allowed: recover now. Lost without recovery: mark the run lost and name the
    command that resumes it. None: the vendor reports nothing wrong (or cannot be asked)."""
    cluster = state.find_cluster(run.cluster)
    if cluster is None:
        return None
    verdict = vendor_trouble(cluster)
    if verdict.reason is None:
        return None
    if verdict.gone and (at_cap(cluster) or (cfg is not None and cfg.teardown == "after-train")):
        return None  # it may have deleted itself (after the run, at the cap): not a loss to recover
    if cfg is not None and cfg.cluster_name == run.cluster and restarts_allowed(cfg) > len(run.restarts):
        recovered = recover(cfg, run, verdict.reason, say)
        say(f"`gpuctl logs -f` follows run {run.run_id} on its new node")
        return recovered
    say(
        f"run {run.run_id} lost: {verdict.reason}. `gpuctl down --yes && gpuctl up --yes && gpuctl train "
        "--resume` resumes it from the newest complete checkpoint"
    )
    return None  # the run stays recorded as running: `down` ends what is left of it
