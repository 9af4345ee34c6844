"""What the rented-machine providers (vast, runpod, aws) share: the `up` flow, `down`, the nodes.

A provider module subclasses CloudBackend and supplies the vendor calls (find_offers, launch,
describe, terminate, list_instances, self_teardown). This module owns the rules around them:
- `up` shows the pick, its $/h and the budget cap, asks (UpOptions.confirm), then records its
  intent (the cluster, each node's label: providers/labels.py) before the first create call and
  each instance id as soon as the vendor answers, so a killed `up` leaves nothing `gpuctl down`
  cannot find; a failure or Ctrl-C (SIGTERM, SIGHUP) before the cluster is ready terminates
  what this attempt created (nothing else), within a bound: a
  second Ctrl-C cannot cut the terminate calls short, only the wait for the vendor to confirm,
  and what is not confirmed gone stays recorded for `gpuctl down`;
- ready means SSH answers with a banner and a command runs, not the vendor saying "running";
- the price a vendor bills a booted node (Instance.price_per_hour, where its API says one)
  replaces the offer's estimate, and the budget cap follows it (prices.py: every cap counts
  what the run's earlier clusters spent);
- `down` terminates the recorded instances and any the vendor lists under the record's labels
  without an id in it, then polls the vendor's own list until they are gone.
gpuctl logs in with the cluster's own ed25519 key (provision/mesh.py's keypair, under the
state dir in keys/<cluster>/), which is also the node-to-node key of a multi-node cluster.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable

from provision.core import interrupt, state
from provision.core.config import GpuctlConfig, check_batch
from provision.core.errors import GpuctlError, NoOfferError, ProviderError
from provision.core.provider_config import CloudProvider
from provision.core.state import ClusterRecord, NodeRecord
from provision.estimate.startup import Term, estimate_line
from provision.providers.abort import UpAbort
from provision.providers.base import (
    IMAGE_PYTHON,
    Offer,
    OfferSource,
    ProviderBackend,
    SelfTeardown,
    UpOptions,
    resolve_runtime,
)
from provision.providers.instance import Instance
from provision.providers.labels import cluster_of, new_labels
from provision.providers.prices import budget_hours, cluster_cap, not_spent
from provision.providers.vendor_images import boot_image
from provision.transport.remote import Node
from provision.transport.ssh import mesh

POLL_S = 2.0
GONE_TIMEOUT_S = 300.0


def planned_node(i: int, offer: Offer, label: str) -> NodeRecord:
    """Node i of a cluster being created: its label and offer, no instance yet."""
    return NodeRecord(
        host=f"node{i}",
        address="",
        label=label,
        slots=offer.num_gpus,
        accelerator="cuda",
        gpu_name=offer.gpu_name,
        host_id=offer.host or None,
        price_per_hour=offer.price_per_hour,
    )


def price_of(value: object) -> float | None:
    """A vendor's $/h figure, when it is one (a number, finite, not negative)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if 0 <= value < float("inf") else None


class LostHostAgain(NoOfferError):
    """The vendor placed a new instance on a host the run lost (it chose the machine, not gpuctl)."""


# --- the shared flow ------------------------------------------------------------------------------


class CloudBackend(ProviderBackend):
    kind = "cloud"
    terminates_nodes = True

    @property
    def offers(self) -> OfferSource:
        return self  # find_offers and filters_text below

    # vendor calls, supplied by each provider module -----------------------------------------------
    def find_offers(self, prov: CloudProvider) -> list[Offer]:
        raise NotImplementedError

    def filters_text(self, prov: CloudProvider) -> str:
        raise NotImplementedError

    def launch(self, prov: CloudProvider, cluster: ClusterRecord, label: str, offer: Offer, public_key: str) -> str:
        """Create one instance named `label` (unique to this attempt); returns its id. Only the
        create call: what follows it (attach) comes once the id is recorded."""
        raise NotImplementedError

    def attach(self, cluster: ClusterRecord, instance_id: str, public_key: str) -> None:
        """What a new instance needs after its create (vast: the cluster key)."""

    def account_missing(self) -> str | None:
        """Why this machine has no account of the vendor configured (no key); None: it has one."""
        raise NotImplementedError

    def default_account(self) -> ClusterRecord | None:
        """The account to look at when no config or record names an endpoint: the vendor's own."""
        return ClusterRecord(name="sweep", provider=self.kind, nodes=[])

    def describe(self, cluster: ClusterRecord, instance_id: str) -> Instance | None:
        """None when the vendor no longer has it."""
        raise NotImplementedError

    def terminate(self, cluster: ClusterRecord, instance_id: str) -> None:
        """Idempotent: an instance that is already gone is fine."""
        raise NotImplementedError

    def list_instances(self, cluster: ClusterRecord) -> list[Instance]:
        """What the vendor lists for this account (the source of truth for `down`)."""
        raise NotImplementedError

    def self_teardown(self, cluster: ClusterRecord) -> SelfTeardown | None:
        raise NotImplementedError

    def picks(self, offers: list[Offer], nodes: int) -> list[Offer]:
        """The offers to launch, one per node; default: the cheapest shape for every node."""
        return [offers[0]] * nodes

    def prepare(self, prov: CloudProvider, cluster: ClusterRecord, public_key: str) -> None:
        """Account-side things launch() needs (AWS: key pair, security group)."""

    def release(self, cluster: ClusterRecord, say: Callable[[str], None]) -> None:
        """Remove what prepare() made, once the instances are gone."""

    # the ProviderBackend interface -------------------------------------------------------------
    def up(self, cfg: GpuctlConfig, opts: UpOptions) -> ClusterRecord | None:
        from provision.estimate.sizing import sized_provider, sizing_note

        prov = sized_provider(cfg)  # min_ram_gb / disk_gb from plan's node figures unless set
        opts.say(sizing_note(cfg, prov))  # the confirmation below shows what plan asked for and why
        offers = [o for o in self.find_offers(prov) if not (o.host and o.host in opts.exclude_hosts)]
        if not offers:
            raise NoOfferError(
                f"no {self.kind} offer matches {self.filters_text(prov)}",
                "relax the filters (max_price, min_ram_gb, gpu, gpus_per_node) or retry later; "
                "`gpuctl offers` lists what matches",
            )
        picks = self.picks(offers, prov.nodes)
        price = sum(o.price_per_hour for o in picks)
        cap = budget_hours(prov, price, spent_hours=opts.spent_hours, spent_cost=opts.spent_cost)
        not_spent(cap, opts.spent_hours, opts.spent_cost)
        for i, offer in enumerate(picks):
            opts.say(f"{self.kind} node {i}: {describe_offer(offer)}")
        span = (f"{cap:.2f} h" if cap >= 1 else f"{cap * 60:.1f} min") if cap else ""
        cap_text = (
            f"budget cap {span} = ${cap * price:.2f} (the node tears itself down then)"
            if cap
            else "no budget cap (set provider.max_hours or max_cost)"
        )
        opts.say(f"total ${price:.3f}/h; {cap_text}")
        mode = resolve_runtime(prov.runtime, self.kind, image=prov.image)  # vast/runpod: image|bootstrap; aws: docker
        image = boot_image(prov, self.kind) if mode == "bootstrap" else prov.image
        startup = self.startup(cfg, mode, image, picks, opts.say)
        from provision.estimate.forecast import warn_cap

        # before it asks, so a cap the run cannot fit in is said before anything is paid
        offered = ClusterRecord(
            name=cfg.cluster_name,
            provider=self.kind,
            nodes=[planned_node(i, offer, "") for i, offer in enumerate(picks)],
            price_per_hour=price,
            budget_hours=cap,
            spent_hours=opts.spent_hours,
            spent_cost=opts.spent_cost,
        )
        warn_cap(cfg, offered, opts.say)
        if opts.dry_run:
            return None
        if not opts.confirm(f"create {len(picks)} {self.kind} node(s) at ${price:.3f}/h?"):
            raise GpuctlError("not confirmed: nothing was created", "rerun `gpuctl up` and answer y, or pass --yes")
        _private, public_key = mesh.cluster_keypair(cfg.cluster_name)
        record = ClusterRecord(
            name=cfg.cluster_name,
            provider=self.kind,
            nodes=[],
            price_per_hour=price,
            image=image,
            runtime=mode,
            api_url=prov.api_url,
            python=IMAGE_PYTHON if mode == "docker" else prov.python,
            identity_file=str(mesh.key_dir(cfg.cluster_name) / "id_ed25519"),
            budget_hours=cap,
            region=getattr(prov, "region", None),
            spent_hours=opts.spent_hours,
            spent_cost=opts.spent_cost,
            startup_estimate={t.name: round(t.seconds, 1) for t in startup} if startup else None,
            startup_line=estimate_line(startup) if startup else None,
        )
        # Import the SSH stack before anything is rented: on a loaded machine paramiko takes
        # seconds to import, and a Ctrl-C during an import can be swallowed (importlib's
        # module-lock callback) or leave half-made modules that the abort could not import.
        from provision.transport.ssh.node import SSHNode  # noqa: F401  (it imports paramiko and connect)

        created: list[str] = []
        labels = new_labels(record.name, list(range(len(picks))))  # a lost create answer is found by its label
        record.nodes = [planned_node(i, offer, labels[i]) for i, offer in enumerate(picks)]
        record.creating = True  # until flows/cluster.py records it up
        with interrupt.guarded():  # a double Ctrl-C cannot get ahead of the abort
            try:
                state.save_cluster(record)  # the intent, before any vendor call creates: a killed `up` is found
                self._create_and_boot(cfg, record, picks, created, public_key, opts.say)
                for node in record.nodes:
                    self.check_not_excluded(record, node, opts.exclude_hosts)
                self._billed(prov, record, opts.say)
            except BaseException as exc:  # Ctrl-C, SIGTERM, SIGHUP included: leave nothing behind
                self._abort(record, created, labels, opts.say, exc)
                raise
        return record

    def startup(
        self, cfg: GpuctlConfig, mode: str, image: str | None, picks: list[Offer], say: Callable[[str], None]
    ) -> list[Term]:
        """The first-step estimate (estimate/startup.py), said before anything is rented: the slowest
        node's download decides (every node pulls and installs at once). AWS (docker runtime) has none."""
        if mode not in ("bootstrap", "image"):
            return []
        from provision.providers.startup_input import startup_terms

        speeds = [o.download_mbps for o in picks if o.download_mbps]
        terms = startup_terms(cfg, mode, image, min(speeds) if speeds else None)
        say(estimate_line(terms))
        return terms

    def _billed(self, prov: CloudProvider, record: ClusterRecord, say: Callable[[str], None]) -> None:
        """The price the vendor bills the booted nodes (their describe answer, where it says one)
        replaces the offers' estimate, and the cap follows it, counting what was spent before."""
        price = round(sum(n.price_per_hour or 0.0 for n in record.nodes), 4)
        if abs(price - (record.price_per_hour or 0.0)) < 0.0005:
            return
        record.price_per_hour = price
        record.budget_hours = cluster_cap(prov, record)
        not_spent(record.budget_hours, record.spent_hours, record.spent_cost)
        say(
            f"{self.kind} bills ${price:.3f}/h"
            + (f"; budget cap {record.budget_hours:.2f} h" if record.budget_hours else "")
        )

    def _create_and_boot(
        self,
        cfg: GpuctlConfig,
        record: ClusterRecord,
        picks: list[Offer],
        created: list[str],
        public_key: str,
        say: Callable[[str], None],
    ) -> None:
        """Create one instance per pick (its id recorded as soon as the vendor answers, and appended
        to `created`), then wait until every node is ready; the node-to-node SSH of a multi-node
        cluster last."""
        from provision.estimate.sizing import sized_provider

        prov = sized_provider(
            cfg
        )  # what the offers were searched with: disk, RAM, uplink, AWS volume speed as plan sized them
        self.prepare(prov, record, public_key)
        for node, offer in zip(record.nodes, picks, strict=True):
            assert node.label is not None  # planned_node gave it one
            node.instance_id = self.launch(prov, record, node.label, offer, public_key)
            created.append(node.instance_id)
            state.save_cluster(record)  # before anything else: `gpuctl down` finds it even if this process dies now
            self.attach(record, node.instance_id, public_key)
            say(f"created {self.kind} instance {node.instance_id}; waiting for it to boot")
        deadline = time.monotonic() + prov.ready_timeout
        for node in record.nodes:
            self.wait_ready(prov, record, node, deadline, say)
        check_batch(cfg.train, record.world_size)
        if len(record.nodes) > 1:  # DeepSpeed's pdsh launcher: node-to-node SSH
            mesh.setup(record, self.nodes(record), say=say)

    def nodes(self, cluster: ClusterRecord) -> list[Node]:
        return [self.ssh_node(cluster, n) for n in cluster.nodes]

    def down(self, cluster: ClusterRecord, say: Callable[[str], None]) -> None:
        ids = [n.instance_id for n in cluster.nodes if n.instance_id]
        for instance_id in ids:  # what the record lists goes first, even if the vendor's list then fails
            self.terminate(cluster, instance_id)
        extra = self.unrecorded(cluster, ids, say)
        for instance_id in extra:
            self.terminate(cluster, instance_id)
        ids += extra
        self.wait_gone(cluster, ids)
        self.release(cluster, say)
        self.forget_local(cluster)
        say(f"terminated {len(ids)} {self.kind} instance(s); {self.kind} no longer lists them")

    def unrecorded(self, cluster: ClusterRecord, ids: list[str], say: Callable[[str], None]) -> list[str]:
        """Instances under the record's labels whose id it lacks: a create whose answer a killed
        `up` (or node replacement) never saw."""
        labels = {n.label for n in cluster.nodes if n.label}
        if not labels:
            return []
        found = [i.id for i in self.list_instances(cluster) if i.label in labels and i.id not in ids]
        if found:
            say(f"{self.kind} lists instance(s) {', '.join(found)} under cluster {cluster.name}'s labels: terminating")
        return found

    def list_ours(self, account: ClusterRecord) -> list[Instance]:
        """Every instance of the account (`account`: api_url, region) that carries a gpuctl label."""
        return [i for i in self.list_instances(account) if cluster_of(i.label)]

    # helpers -------------------------------------------------------------------------------------
    def ssh_node(self, cluster: ClusterRecord, node: NodeRecord, *, pin_new: bool = False) -> Node:
        from provision.transport.ssh.node import SSHNode

        return SSHNode.from_record(node, cluster.identity_file, pin_new=pin_new, label=f"{cluster.name}/{node.host}")

    def wait_gone(self, cluster: ClusterRecord, ids: list[str], timeout_s: float = GONE_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            interrupt.check()
            left = sorted({i.id for i in self.list_instances(cluster)} & set(ids))
            if not left:
                return
            if time.monotonic() > deadline:
                raise ProviderError(
                    f"{self.kind} still lists instance(s) {', '.join(left)} {timeout_s:.0f}s after terminating them",
                    f"check the {self.kind} console, then retry `gpuctl down`",
                )
            time.sleep(POLL_S)

    def wait_ready(
        self, prov: CloudProvider, cluster: ClusterRecord, node: NodeRecord, deadline: float, say: Callable[[str], None]
    ) -> None:
        """Wait until one booting node is usable (`up`, and `replace_node` for a new node): see boot.py."""
        from provision.providers.boot import wait_ready

        wait_ready(self, prov, cluster, node, deadline, say, POLL_S)

    def check_not_excluded(self, cluster: ClusterRecord, node: NodeRecord, exclude: set[str]) -> None:
        """A vendor that places a pod itself (runpod) may put it on a host this run lost."""
        if node.host_id and node.host_id in exclude:
            raise LostHostAgain(
                f"{self.kind} placed instance {node.instance_id} on machine {node.host_id}, "
                "which this run lost before (recovery.exclude_lost_hosts)",
                "retry later, or set recovery.exclude_lost_hosts: false",
            )

    def undo_up(self, cluster: ClusterRecord, say: Callable[[str], None], failure: BaseException | None = None) -> bool:
        """`up` was interrupted or failed after this backend returned (record saved, image shipping,
        guard): terminate its instances the way an interrupted or failed create does."""
        ids = [n.instance_id for n in cluster.nodes if n.instance_id]
        self._abort(cluster, ids, [], say, failure or KeyboardInterrupt())
        return True

    def _abort(
        self,
        cluster: ClusterRecord,
        created: list[str],
        labels: list[str],
        say: Callable[[str], None],
        exc: BaseException,
    ) -> None:
        """Terminate what this attempt created (providers/abort.py: bounded, a second Ctrl-C
        answered, what is not confirmed gone kept recorded for `gpuctl down`)."""
        why = "interrupted" if isinstance(exc, KeyboardInterrupt) else "up failed"
        UpAbort(self, cluster, say).run(created, labels, why)

    def forget_local(self, cluster: ClusterRecord) -> None:
        """Cloud addresses are reused: drop the nodes' pinned host keys and the cluster key."""
        from provision.transport.ssh.node import forget_host

        for node in cluster.nodes:
            if node.address:
                forget_host(f"{node.address}:{node.port}")
        shutil.rmtree(mesh.key_dir(cluster.name), ignore_errors=True)


def describe_offer(offer: Offer) -> str:
    extra = [
        f"{offer.ram_gb:.0f} GB RAM" if offer.ram_gb else "",
        f"{offer.disk_gb:.0f} GB disk" if offer.disk_gb else "",
        offer.where,
        f"reliability {offer.reliability:.3f}" if offer.reliability is not None else "",
        "interruptible (bid)" if offer.spot else "",
    ]
    details = ", ".join(e for e in extra if e)
    return f"offer {offer.id}: {offer.num_gpus} x {offer.gpu_name} at ${offer.price_per_hour:.3f}/h" + (
        f" ({details})" if details else ""
    )
