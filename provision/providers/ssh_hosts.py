"""Provider `ssh`: machines you already have, listed in gpuctl.yaml as user@host:port or as
Host aliases of the user's ssh config (transport/ssh/aliases.py: HostName, User, Port,
IdentityFile, ProxyJump, ...; the route is recorded with each node).

`up` connects to every host, through its jump hosts (retrying a booting node with backoff
until provider.ready_timeout), pins its host key and the jump hosts' in gpuctl's known_hosts on
first contact, checks the nodes all at once (fabric ThreadingGroup: python with
torch/deepspeed/transformers, or a container runtime; GPUs and driver via nvidia-smi; free
disk; RAM) and records the cluster. With 2+ hosts it also sets up node-to-node SSH for
DeepSpeed's pdsh launcher (transport/ssh/mesh.py; the nodes reach each other directly, only the
laptop uses the jump hosts). `down` stops the processes of this cluster's runs on every node
and removes what `up` put there; the machines themselves are yours and stay.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tenacity import RetryCallState, Retrying, retry_if_exception, stop_before_delay, wait_exponential

from provision.core import state
from provision.core.config import GpuctlConfig
from provision.core.errors import ConfigError, RemoteError
from provision.core.provider_config import SSHProvider
from provision.core.ssh_route import SSHRoute
from provision.providers.base import ProviderBackend, SelfTeardown, UpOptions
from provision.transport.remote import Node
from provision.transport.ssh import mesh
from provision.transport.ssh.cleanup import stop_run_processes
from provision.transport.ssh.connect import ConnectError
from provision.transport.ssh.node import SSHNode

__all__ = ["BACKEND", "SSHBackend", "Target", "hostfile_names", "stop_run_processes", "targets"]

NODE_MODULES = ("torch", "deepspeed", "transformers")
LOW_DISK_GB = 20
SAFE_PATH = re.compile(r"^[A-Za-z0-9_./+=:@-]+$")

# $1 = the configured python. Prints key=value lines; needs nothing but a POSIX shell + bash.
PROBE = r'''echo "home=$HOME"
if p=$(command -v "$1" 2>/dev/null); then
  echo "python=$p"
  "$p" -c 'import importlib.util as u, sys
print("missing=" + ",".join(m for m in sys.argv[1:] if u.find_spec(m) is None))
print("pyver=%d.%d.%d" % sys.version_info[:3])' torch deepspeed transformers 2>/dev/null
fi
for t in docker podman pdsh ssh; do command -v "$t" >/dev/null 2>&1 && echo "tool=$t"; done
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader,nounits 2>/dev/null | sed 's/^/gpu=/'
fi
echo "disk_kb=$(df -Pk "$HOME" 2>/dev/null | awk 'NR==2{print $4}')"
echo "mem_kb=$(awk '/^MemTotal:/{print $2}' /proc/meminfo 2>/dev/null)"
echo "cpus=$(nproc 2>/dev/null)"'''


@dataclass
class Target:
    user: str
    address: str
    port: int
    route: SSHRoute | None = None  # from ssh_config: jump hosts, keys, timeouts

    @property
    def where(self) -> str:
        via = f" via {self.route.jumps[-1].where}" if self.route and self.route.jumps else ""
        return f"{self.user}@{self.address}:{self.port}{via}"


@dataclass
class NodeFacts:
    home: str = ""
    python: str | None = None
    pyver: str | None = None
    missing: list[str] = field(default_factory=list)
    tools: set[str] = field(default_factory=set)
    gpus: list[tuple[str, str, str]] = field(default_factory=list)  # name, driver, MiB
    disk_gb: float | None = None
    mem_gb: float | None = None
    cpus: int | None = None

    @classmethod
    def parse(cls, text: str) -> NodeFacts:
        facts = cls()
        for line in text.splitlines():
            key, _, value = line.partition("=")
            value = value.strip()
            if key == "home":
                facts.home = value
            elif key == "python":
                facts.python = value
            elif key == "pyver":
                facts.pyver = value
            elif key == "missing":
                facts.missing = [m for m in value.split(",") if m]
            elif key == "tool":
                facts.tools.add(value)
            elif key == "gpu":
                parts = [p.strip() for p in value.split(",")] + ["", ""]
                facts.gpus.append((parts[0], parts[1], parts[2]))
            elif key == "disk_kb" and value.isdigit():
                facts.disk_gb = int(value) / 1024**2
            elif key == "mem_kb" and value.isdigit():
                facts.mem_gb = int(value) / 1024**2
            elif key == "cpus" and value.isdigit():
                facts.cpus = int(value)
        return facts

    @property
    def has_modules(self) -> bool:
        return self.python is not None and not self.missing

    @property
    def runtime(self) -> str | None:
        return next((t for t in ("docker", "podman") if t in self.tools), None)


def targets(prov: SSHProvider) -> list[Target]:
    """provider.hosts through ssh_config (provider.ssh_config or ~/.ssh/config), as ssh reads them."""
    from provision.transport.ssh import aliases

    config, shown = aliases.load(prov.ssh_config)
    out = []
    for i, spec in enumerate(prov.hosts):
        found = aliases.resolve(spec, config, f"provider.hosts[{i}] {spec!r}", shown)
        out.append(Target(found.user, found.address, found.port, found.route))
    return out


def identity_path(cfg: GpuctlConfig) -> str | None:
    prov = cfg.provider
    if not isinstance(prov, SSHProvider) or not prov.identity_file:
        return None
    path = Path(prov.identity_file).expanduser()
    return str(path if path.is_absolute() else (Path.cwd() / path).resolve())


def hostfile_names(found: list[Target]) -> list[str]:
    """What the hostfile (and pdsh -w) calls each node: its address, `user@address` when its
    user differs from the first node's (pdsh would log in as the first node's user), and
    `node<i>` aliases when two nodes share an address (the node ssh config maps them)."""
    if len({t.address for t in found}) < len(found):
        return [f"node{i}" for i in range(len(found))]
    first = found[0].user
    return [t.address if t.user == first else f"{t.user}@{t.address}" for t in found]


def connect(
    target: Target, prov: SSHProvider, identity: str | None, deadline_s: float, say: Callable[[str], None]
) -> SSHNode:
    """Connect (pinning the node's and its jump hosts' keys on first contact); a node still
    booting (refused, no answer, no banner yet) is retried with backoff until the deadline."""
    node = SSHNode(
        target.address,
        target.port,
        target.user,
        identity,
        connect_timeout=prov.connect_timeout,
        pin_new=True,
        route=target.route,
    )

    def note(retry_state: RetryCallState) -> None:
        exc = retry_state.outcome.exception() if retry_state.outcome else None
        message = exc.message if isinstance(exc, ConnectError) else str(exc)  # only ConnectErrors are retried
        say(f"{target.where}: not ready ({message.split(': ', 1)[-1]}); retrying")

    retrying = Retrying(
        retry=retry_if_exception(lambda e: isinstance(e, ConnectError) and e.transient),
        wait=wait_exponential(multiplier=0.5, max=8),
        stop=stop_before_delay(deadline_s),
        before_sleep=note,
        reraise=True,
    )
    for attempt in retrying:
        with attempt:
            node.connection()
    return node


def check_nodes(nodes: list[SSHNode], prov: SSHProvider) -> list[NodeFacts]:
    """The node checks (python and its modules, tools, GPUs, disk, RAM) on every node at once."""
    from provision.transport.ssh.group import run_on_all

    results = run_on_all(
        nodes, ["bash", "-c", PROBE, "gpuctl", prov.python], timeout=max(30.0, prov.connect_timeout * 3)
    )
    return [NodeFacts.parse(r.stdout) for r in results]


def slots_for(prov: SSHProvider, facts: NodeFacts, where: str) -> tuple[int, str, str | None]:
    """(slots, accelerator, gpu name) for a node."""
    if facts.gpus:
        slots = prov.gpus_per_node or len(facts.gpus)
        if slots > len(facts.gpus):
            raise ConfigError(
                f"provider.gpus_per_node is {slots} but {where} has {len(facts.gpus)} GPUs",
                f"set gpus_per_node to at most {len(facts.gpus)}",
            )
        return slots, "cuda", facts.gpus[0][0]
    if prov.gpus_per_node:  # no nvidia-smi on the host (e.g. only inside the container): trust the config
        return prov.gpus_per_node, "cuda", None
    return prov.cpu_ranks, "cpu", None


def describe(facts: NodeFacts, slots: int, accel: str) -> str:
    if facts.gpus:
        name, driver, mib = facts.gpus[0]
        what = f"{slots} x {name} (driver {driver}, {int(mib or 0) // 1024} GiB)"
    else:
        what = f"{slots} {'GPU' if accel == 'cuda' else 'CPU'} ranks" + ("" if accel == "cuda" else " (no GPU seen)")
    disk = f"{facts.disk_gb:.0f} GB free disk" if facts.disk_gb is not None else "disk unknown"
    mem = f"{facts.mem_gb:.0f} GB RAM" if facts.mem_gb is not None else "RAM unknown"
    py = f"python {facts.pyver} at {facts.python}" if facts.python else "no python"
    return f"{what}, {py}, {disk}, {mem}"


class SSHBackend(ProviderBackend):
    def up(self, cfg: GpuctlConfig, opts: UpOptions) -> state.ClusterRecord | None:
        prov = cfg.provider
        assert isinstance(prov, SSHProvider)
        found = targets(prov)
        identity = identity_path(cfg)
        if opts.dry_run:
            for t in found:
                opts.say(f"would connect to {t.where} (key {identity or 'agent/default'}) and check it")
            return None
        started = time.monotonic()
        nodes: list[SSHNode] = []
        for t in found:
            left = max(1.0, prov.ready_timeout - (time.monotonic() - started))
            nodes.append(connect(t, prov, identity, left, opts.say))
        facts = check_nodes(nodes, prov)
        runtime = self._runtime(prov, found, facts)
        workdir = self._workdir(prov, nodes, facts)
        names = hostfile_names(found)
        records = []
        for t, fact, name in zip(found, facts, names, strict=True):
            slots, accel, gpu = slots_for(prov, fact, t.where)
            records.append(
                state.NodeRecord(
                    host=name,
                    address=t.address,
                    port=t.port,
                    user=t.user,
                    slots=slots,
                    accelerator=accel,
                    gpu_name=gpu,
                    workdir=workdir,
                    ssh=t.route,
                )
            )
            opts.say(f"{t.where}: {describe(fact, slots, accel)}")
            if fact.disk_gb is not None and fact.disk_gb < LOW_DISK_GB:
                opts.say(
                    f"warning: {t.where} has only {fact.disk_gb:.1f} GB free in {fact.home}; checkpoints may not fit"
                )
        if len({r.accelerator for r in records}) > 1:
            raise ConfigError("some hosts have GPUs and some do not", "list hosts of one kind in provider.hosts")
        python = facts[0].python if runtime == "none" and facts[0].python else prov.python
        cluster = state.ClusterRecord(
            name=cfg.cluster_name,
            provider="ssh",
            nodes=records,
            python=python,
            runtime=runtime,
            image=prov.image if runtime == "docker" else None,
            identity_file=identity,
        )
        if len(records) > 1:
            self._check_multinode(cluster, found, facts, runtime)
            try:
                mesh.setup(cluster, nodes, prov.authorized_keys, opts.say)
            except BaseException:
                mesh.teardown(cluster, nodes, opts.say)  # this attempt's key off the nodes again
                raise
        return cluster

    def _runtime(self, prov: SSHProvider, found: list[Target], facts: list[NodeFacts]) -> str:
        mode = prov.runtime
        if mode == "auto":
            ready = all(f.has_modules for f in facts)
            mode = "docker" if not ready and prov.image and all(f.runtime for f in facts) else "none"
        if mode == "docker":
            lacking = [t.where for t, f in zip(found, facts, strict=True) if not f.runtime]
            if lacking:
                raise ConfigError(
                    f"provider.runtime is docker but {lacking[0]} has no docker/podman",
                    "install Docker there, or set runtime: none with a python that has deepspeed",
                )
            if not prov.image:
                raise ConfigError(
                    "provider.runtime is docker but provider.image is not set",
                    "set provider.image to the trainer image",
                )
            return "docker"
        for t, f in zip(found, facts, strict=True):
            if f.python is None and not prov.setup:
                raise ConfigError(
                    f"{t.where}: {prov.python} not found on the node",
                    "set provider.python to an interpreter there, or provider.setup to install one",
                )
            if f.missing and not prov.setup:
                raise ConfigError(
                    f"{t.where}: {f.python} lacks {', '.join(f.missing)}",
                    "pip install 'gpuctl[train]' there (torch first), set provider.python to a "
                    "python that has them, or set provider.setup to install them",
                )
        return "none"

    def _workdir(self, prov: SSHProvider, nodes: list[SSHNode], facts: list[NodeFacts]) -> str:
        """One path on every node (DeepSpeed's pdsh launch `cd`s to the first node's run dir)."""
        home = facts[0].home.rstrip("/") or "/root"
        workdir = prov.workdir or "gpuctl"
        if workdir.startswith("~/") or workdir == "~":
            workdir = home + workdir[1:]
        elif not workdir.startswith("/"):
            workdir = f"{home}/{workdir}"
        from provision.transport.ssh.group import run_on_all

        script = '[ -d "$1" ] || { mkdir -p -- "$1" && chmod 700 -- "$1"; }; [ -w "$1" ]'
        results = run_on_all(nodes, ["bash", "-c", script, "gpuctl", workdir], timeout=60, check=False)
        for node, result in zip(nodes, results, strict=True):
            if result.rc != 0:
                raise ConfigError(
                    f"{node.label}: cannot create or write {workdir}",
                    "set provider.workdir to a folder the SSH user may write on every node",
                )
        return workdir

    def _check_multinode(
        self, cluster: state.ClusterRecord, found: list[Target], facts: list[NodeFacts], runtime: str
    ) -> None:
        first = facts[0]
        for what, value in (("workdir", cluster.nodes[0].workdir), ("python", cluster.python)):
            if not SAFE_PATH.match(value):
                raise ConfigError(
                    f"provider.{what} {value!r} has spaces or shell characters; DeepSpeed's "
                    "multi-node launcher pastes it unquoted into the pdsh command",
                    f"use a {what} path of letters, digits and ._+-/ only",
                )
        for tool in ("pdsh", "ssh"):
            if runtime == "none" and tool not in first.tools:
                raise ConfigError(
                    f"{found[0].where}: `{tool}` is not installed; DeepSpeed's multi-node "
                    "launcher runs pdsh over ssh from the first node",
                    "apt-get install -y pdsh openssh-client on the first node",
                )
        if runtime == "none":
            for t, f in zip(found[1:], facts[1:], strict=True):
                if f.python and first.python and f.python != first.python:
                    raise ConfigError(
                        f"python is {first.python} on {found[0].where} but {f.python} on {t.where}; "
                        "DeepSpeed starts the ranks with the first node's interpreter path",
                        "install the same python path on every node (or set provider.python)",
                    )

    def nodes(self, cluster: state.ClusterRecord) -> list[Node]:
        return [SSHNode.from_record(n, cluster.identity_file) for n in cluster.nodes]

    def down(self, cluster: state.ClusterRecord, say: Callable[[str], None]) -> None:
        nodes = [SSHNode.from_record(n, cluster.identity_file) for n in cluster.nodes]
        run_dirs = [r.run_dir for r in state.list_runs(cluster.name)]
        try:
            reachable: list[Node] = []
            for node in nodes:
                try:
                    node.connection()
                    reachable.append(node)
                except RemoteError as exc:
                    say(f"warning: could not reach {node.label} to stop its run processes: {exc.message}")
            try:
                stop_run_processes(reachable, run_dirs, say)  # on every node at once
                for node, rec in zip(nodes, cluster.nodes, strict=True):
                    if node in reachable and rec.workdir and (left := node.remove_run_secrets(rec.workdir)):
                        say(f"{node.label}: removed {left} run secrets file(s) a killed run left behind")
            except RemoteError as exc:
                say(f"warning: stopping the run processes failed: {exc.message}")
            mesh.teardown(cluster, nodes, say)
        finally:
            for node in nodes:
                node.close()
        say(f"{len(nodes)} SSH host(s) disconnected (the machines stay; gpuctl forgets the cluster)")

    def self_teardown(self, cluster: state.ClusterRecord) -> SelfTeardown | None:
        return None  # your own machines: nothing to delete


BACKEND = SSHBackend()
