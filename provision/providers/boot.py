"""A new cloud instance becoming a usable node (`up`, and `replace_node` for a new node): the
vendor says running with an address -> an SSH banner -> a command runs (the login works) -> the
GPUs are probed -> under runtime bootstrap, the node side is installed (providers/bootstrap.py).
Ready means that, not the vendor saying "running"."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from provision.core import interrupt
from provision.core.errors import ProviderError
from provision.core.provider_config import CloudProvider
from provision.core.state import ClusterRecord, NodeRecord
from provision.providers.instance import Instance
from provision.transport.remote import Node


class Vendor(Protocol):
    """What booting asks of the backend: what cloud.CloudBackend has (named by shape, so cloud.py
    imports this module and not the other way round)."""

    @property
    def kind(self) -> str: ...

    def describe(self, cluster: ClusterRecord, instance_id: str) -> Instance | None: ...

    def ssh_node(self, cluster: ClusterRecord, node: NodeRecord, *, pin_new: bool = False) -> Node: ...


def wait_ready(
    backend: Vendor,
    prov: CloudProvider,
    cluster: ClusterRecord,
    node: NodeRecord,
    deadline: float,
    say: Callable[[str], None],
    poll_s: float,
) -> None:
    """`poll_s`: between looks at the vendor and SSH (the backend's, cloud.POLL_S, read at each call)."""
    from provision.transport.ssh.connect import ConnectError, HostKeyRefused, wait_for_ssh

    kind = backend.kind
    assert node.instance_id is not None  # up() records every node's instance id before it waits
    seen: tuple[str, str] | None = None
    started = time.monotonic()  # the image pull phase: until an SSH login works (node.boot_s)
    while True:
        interrupt.check()  # a Ctrl-C that a finalizer swallowed (see core/interrupt.py)
        inst = backend.describe(cluster, node.instance_id)
        if inst is None or inst.failed:
            what = "vanished" if inst is None else f"ended in state {inst.state!r}"
            raise ProviderError(
                f"{kind} instance {node.instance_id} {what} while booting",
                f"retry `gpuctl up`; check the {kind} console for its log",
            )
        if inst.ready and inst.address:
            break
        if (inst.state, inst.detail) != seen:  # Vast's status_msg tells the image pull's progress
            say(f"{kind} instance {node.instance_id}: {inst.state}" + (f" ({inst.detail})" if inst.detail else ""))
            seen = (inst.state, inst.detail)
        if time.monotonic() > deadline:
            raise ProviderError(
                f"{kind} instance {node.instance_id} still {inst.state!r} after {prov.ready_timeout:.0f}s",
                "raise provider.ready_timeout or retry",
            )
        time.sleep(poll_s)
    node.address, node.port, node.user = inst.address, inst.port, inst.user
    node.price_per_hour = inst.price_per_hour or node.price_per_hour  # the bill, not the offer's estimate
    node.private_address = inst.private_address
    node.host_id = inst.host or node.host_id
    wait_for_ssh(inst.address, inst.port, deadline, say=say)
    ssh = backend.ssh_node(cluster, node, pin_new=True)
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
                time.sleep(poll_s)
        node.boot_s = round(time.monotonic() - started, 1)
        say(f"{node.host}: image pulled and booted in {node.boot_s:.0f}s")
        probe(kind, prov, node, ssh, home, say)
        if cluster.runtime == "bootstrap":  # the node side over the vendor's PyTorch image
            from provision.providers.bootstrap import install

            cluster.python = install(ssh, node, prov.python, say)
    finally:
        ssh.close()


def probe(kind: str, prov: CloudProvider, node: NodeRecord, ssh: Node, home: str, say: Callable[[str], None]) -> None:
    """The node's workdir and GPUs (nvidia-smi); a node with none is an error unless cpu_ranks_fallback."""
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
            f"{kind} instance {node.instance_id} shows no GPU (nvidia-smi found none)",
            "pick another offer; set provider.cpu_ranks_fallback only for CPU test stand-ins",
        )
