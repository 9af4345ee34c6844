"""What the rented-machine providers (vast, runpod, aws) share: the `up` flow, `down`, the nodes.

A provider module subclasses CloudBackend and supplies the vendor calls (find_offers, launch,
describe, terminate, list_instances, self_teardown). This module owns the rules around them:
- `up` shows the pick, its $/h and the budget cap, asks (UpOptions.confirm), then creates;
  every created instance is recorded in state at once, and a failure or Ctrl-C before the
  cluster is ready terminates what this attempt created (nothing else), within a bound: a
  second Ctrl-C cannot cut the terminate calls short, only the wait for the vendor to confirm,
  and what is not confirmed gone stays recorded for `gpuctl down`;
- ready means SSH answers with a banner and a command runs, not the vendor saying "running";
- `down` terminates, then polls the vendor's own list until the instances are gone.
gpuctl logs in with the cluster's own ed25519 key (provision/mesh.py's keypair, under the
state dir in keys/<cluster>/), which is also the node-to-node key of a multi-node cluster.
"""

from __future__ import annotations

import secrets
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass

from provision.core import interrupt, state
from provision.core.config import GpuctlConfig, check_batch
from provision.core.errors import GpuctlError, NoOfferError, ProviderError
from provision.core.provider_config import CloudProvider
from provision.core.state import ClusterRecord, NodeRecord
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
from provision.transport.remote import Node
from provision.transport.ssh import mesh

POLL_S = 2.0
GONE_TIMEOUT_S = 300.0


@dataclass
class Instance:
    """What the vendor says about one instance right now."""

    id: str
    state: str  # the vendor's own word, for messages
    ready: bool = False  # the vendor considers it running and gave an SSH address
    failed: bool = False  # a terminal state: it will never become ready
    address: str | None = None
    port: int = 22
    user: str = "root"
    label: str = ""
    private_address: str | None = None  # where the other nodes reach it (AWS: inside the VPC)
    host: str = ""  # the vendor's machine behind it, where its API names one (runpod: machineId)


class LostHostAgain(NoOfferError):
    """The vendor placed a new instance on a host the run lost (it chose the machine, not gpuctl)."""


def budget_hours(
    prov: CloudProvider, price_per_hour: float, spent_hours: float = 0.0, spent_cost: float = 0.0
) -> float | None:
    """Hours this cluster may run; spent_*: earlier clusters of the same run (a recovered node)."""
    caps = [prov.max_hours - spent_hours] if prov.max_hours else []
    if prov.max_cost and price_per_hour > 0:
        caps.append((prov.max_cost - spent_cost) / price_per_hour)
    return min(caps) if caps else None


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
        """Create one instance named `label` (unique to this attempt); returns its id."""
        raise NotImplementedError

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
        cap = budget_hours(prov, price, opts.spent_hours, opts.spent_cost)
        if cap is not None and cap <= 0:
            raise GpuctlError(
                f"the budget cap is spent ({opts.spent_hours:.2f} h, ${opts.spent_cost:.2f} so far)",
                "raise provider.max_hours / max_cost",
            )
        for i, offer in enumerate(picks):
            opts.say(f"{self.kind} node {i}: {describe_offer(offer)}")
        span = (f"{cap:.2f} h" if cap >= 1 else f"{cap * 60:.1f} min") if cap else ""
        cap_text = (
            f"budget cap {span} = ${cap * price:.2f} (the node tears itself down then)"
            if cap
            else "no budget cap (set provider.max_hours or max_cost)"
        )
        opts.say(f"total ${price:.3f}/h; {cap_text}")
        if opts.dry_run:
            return None
        if not opts.confirm(f"create {len(picks)} {self.kind} node(s) at ${price:.3f}/h?"):
            raise GpuctlError("not confirmed: nothing was created", "rerun `gpuctl up` and answer y, or pass --yes")
        _private, public_key = mesh.cluster_keypair(cfg.cluster_name)
        mode = resolve_runtime(prov.runtime, self.kind, image=prov.image)  # vast/runpod: image; aws: docker
        record = ClusterRecord(
            name=cfg.cluster_name,
            provider=self.kind,
            nodes=[],
            price_per_hour=price,
            image=prov.image,
            runtime=mode,
            api_url=prov.api_url,
            python=IMAGE_PYTHON if mode == "docker" else prov.python,
            identity_file=str(mesh.key_dir(cfg.cluster_name) / "id_ed25519"),
            budget_hours=cap,
            region=getattr(prov, "region", None),
            spent_hours=opts.spent_hours,
            spent_cost=opts.spent_cost,
        )
        # Import the SSH stack before anything is rented: on a loaded machine paramiko takes
        # seconds to import, and a Ctrl-C during an import can be swallowed (importlib's
        # module-lock callback) or leave half-made modules that the abort could not import.
        from provision.transport.ssh.node import SSHNode  # noqa: F401  (it imports paramiko and connect)

        created: list[str] = []
        attempt = secrets.token_hex(3)  # in every label: a failed create is found by it, nothing else
        labels = [f"gpuctl-{record.name}-{i}-{attempt}" for i in range(len(picks))]
        with interrupt.guarded():  # a double Ctrl-C cannot get ahead of the abort
            try:
                self._create_and_boot(cfg, record, picks, labels, created, public_key, opts.say)
                for node in record.nodes:
                    self.check_not_excluded(record, node, opts.exclude_hosts)
            except BaseException as exc:  # Ctrl-C included: leave nothing behind
                self._abort(record, created, labels, opts.say, exc)
                raise
        return record

    def _create_and_boot(
        self,
        cfg: GpuctlConfig,
        record: ClusterRecord,
        picks: list[Offer],
        labels: list[str],
        created: list[str],
        public_key: str,
        say: Callable[[str], None],
    ) -> None:
        """Create one instance per pick (each recorded at once, its id appended to `created`), then
        wait until every node is ready; the node-to-node SSH of a multi-node cluster last."""
        from provision.estimate.sizing import sized_provider

        prov = sized_provider(cfg)  # rent what the offers were filtered on (disk, AWS volume speed)
        self.prepare(prov, record, public_key)
        for i, offer in enumerate(picks):
            instance_id = self.launch(prov, record, labels[i], offer, public_key)
            created.append(instance_id)
            record.nodes.append(
                NodeRecord(
                    host=f"node{i}",
                    address="",
                    instance_id=instance_id,
                    slots=offer.num_gpus,
                    accelerator="cuda",
                    gpu_name=offer.gpu_name,
                    host_id=offer.host or None,
                    price_per_hour=offer.price_per_hour,
                )
            )
            state.save_cluster(record)  # `gpuctl down` finds it even if this process dies now
            say(f"created {self.kind} instance {instance_id}; waiting for it to boot")
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
        for instance_id in ids:
            self.terminate(cluster, instance_id)
        self.wait_gone(cluster, ids)
        self.release(cluster, say)
        self.forget_local(cluster)
        say(f"terminated {len(ids)} {self.kind} instance(s); {self.kind} no longer lists them")

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
        """Wait until one booting node is usable (`up`, and `replace_node` for a new node): vendor says
        running with an address -> SSH banner -> a command runs -> probe GPUs."""
        from provision.transport.ssh.connect import ConnectError, HostKeyRefused, wait_for_ssh

        assert node.instance_id is not None  # up() records every node with its instance id
        seen = None
        while True:
            interrupt.check()  # a Ctrl-C that a finalizer swallowed (see core/interrupt.py)
            inst = self.describe(cluster, node.instance_id)
            if inst is None or inst.failed:
                what = "vanished" if inst is None else f"ended in state {inst.state!r}"
                raise ProviderError(
                    f"{self.kind} instance {node.instance_id} {what} while booting",
                    f"retry `gpuctl up`; check the {self.kind} console for its log",
                )
            if inst.ready and inst.address:
                break
            if inst.state != seen:
                say(f"{self.kind} instance {node.instance_id}: {inst.state}")
                seen = inst.state
            if time.monotonic() > deadline:
                raise ProviderError(
                    f"{self.kind} instance {node.instance_id} still {inst.state!r} after {prov.ready_timeout:.0f}s",
                    "raise provider.ready_timeout or retry",
                )
            time.sleep(POLL_S)
        node.address, node.port, node.user = inst.address, inst.port, inst.user
        node.private_address = inst.private_address
        node.host_id = inst.host or node.host_id
        wait_for_ssh(inst.address, inst.port, deadline, say=say)
        ssh = self.ssh_node(cluster, node, pin_new=True)
        try:
            while True:  # sshd answers before the key is installed on some images: retry auth
                interrupt.check()
                try:
                    home = ssh.home()
                    break
                except ConnectError as exc:
                    if time.monotonic() > deadline or isinstance(exc, HostKeyRefused):
                        raise
                    say(f"waiting for SSH login: {exc.message}")
                    time.sleep(POLL_S)
            self._probe(prov, node, ssh, home, say)
        finally:
            ssh.close()

    def _probe(self, prov: CloudProvider, node: NodeRecord, ssh: Node, home: str, say: Callable[[str], None]) -> None:
        node.workdir = prov.workdir or f"{home.rstrip('/')}/gpuctl"
        out = ssh.sh(
            "command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name --format=csv,noheader",
            check=False,
            timeout=60,
        ).stdout
        gpus = [line.strip() for line in out.splitlines() if line.strip()]
        if gpus:
            node.slots = min(len(gpus), prov.gpus_per_node)
            node.accelerator, node.gpu_name = "cuda", gpus[0]
            if len(gpus) < prov.gpus_per_node:
                say(f"warning: {node.host} shows {len(gpus)} GPU(s), fewer than the {prov.gpus_per_node} rented")
        elif prov.cpu_ranks_fallback:
            node.slots, node.accelerator, node.gpu_name = prov.cpu_ranks_fallback, "cpu", None
            say(
                f"warning: {node.host} shows no GPU (no nvidia-smi output); running "
                f"{prov.cpu_ranks_fallback} CPU ranks (provider.cpu_ranks_fallback)"
            )
        else:
            raise ProviderError(
                f"{self.kind} instance {node.instance_id} shows no GPU (nvidia-smi found none)",
                "pick another offer; set provider.cpu_ranks_fallback only for CPU test stand-ins",
            )

    def check_not_excluded(self, cluster: ClusterRecord, node: NodeRecord, exclude: set[str]) -> None:
        """A vendor that places a pod itself (runpod) may put it on a host this run lost."""
        if node.host_id and node.host_id in exclude:
            raise LostHostAgain(
                f"{self.kind} placed instance {node.instance_id} on machine {node.host_id}, "
                "which this run lost before (recovery.exclude_lost_hosts)",
                "retry later, or set recovery.exclude_lost_hosts: false",
            )

    def undo_up(self, cluster: ClusterRecord, say: Callable[[str], None]) -> bool:
        """`up` was interrupted after this backend returned (record saved, image shipping):
        terminate its instances the way an interrupted create does."""
        ids = [n.instance_id for n in cluster.nodes if n.instance_id]
        self._abort(cluster, ids, [], say, KeyboardInterrupt())
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
