"""The train flow: render -> put bundle -> start detached -> follow logs/status -> result.

The run lives on the node: launch.sh writes status.json, the trainer writes metrics.jsonl
and summary.json. gpuctl only reads them, so a dropped laptop changes nothing.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from provision.core import interrupt, state
from provision.core.errors import GpuctlError, RemoteError
from provision.flows import nodedata
from provision.providers import backend
from provision.transport import remote
from trainer.objstore.atomic import atomic_write

if TYPE_CHECKING:  # status, logs and cancel only read records: render (jinja2) and the config load with train
    from provision.core.config import GpuctlConfig
    from provision.core.credentials import StorageCredentials
    from provision.flows.render import BundleSpec
    from provision.transport.remote import Node

TERMINAL = ("succeeded", "failed", "cancelled", "lost")
POLL_S = 0.5
KILL_REAP_S = 10.0  # after KILL in `cancel`: killed processes linger until reaped
T = TypeVar("T")


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


def run_dir_of(workdir: str, run_id: str) -> str:
    return f"{workdir.rstrip('/')}/runs/{run_id}"


def check_budget_left(cluster: state.ClusterRecord, hours: float) -> None:
    """That the cluster's budget cap (max_hours, max_cost at its price: `hours`) is not spent yet."""
    if cluster.created_at + hours * 3600 - time.time() < 1:
        raise GpuctlError(
            f"cluster {cluster.name} has spent its budget cap ({hours:.2f} h)",
            "`gpuctl down`, or raise provider.max_hours / max_cost and `gpuctl up` again",
        )


def bundle_spec(
    cfg: GpuctlConfig,
    cluster: state.ClusterRecord,
    run_id: str,
    resume: str | None = None,
    *,
    credentials: StorageCredentials | None = None,
    secrets_env: dict[str, str] | None = None,
) -> BundleSpec:
    """credentials: the node's storage credentials (default: resolved now from boto3's chain);
    secrets_env: the values of gpuctl.yaml's `secrets:` (train reads them; render leaves them out)."""
    from provision.core.credentials import storage_credentials
    from provision.flows.render import BundleNode, BundleSpec

    first = cluster.nodes[0]
    spec = BundleSpec(
        run_id=run_id,
        run_dir=run_dir_of(first.workdir, run_id),
        nodes=[BundleNode(host, slots) for host, slots in cluster.rank_nodes()],
        python=cluster.python,
        accelerator=first.accelerator,
        gpu_name=first.gpu_name,
        resume=resume,
        setup=getattr(cfg.provider, "setup", None),
        scheduler="slurm" if cluster.slurm else None,
    )
    if len(cluster.nodes) > 1:
        from provision.transport.ssh.mesh import node_ssh_config

        spec.master_addr = first.private_address or first.address  # AWS: inside the VPC, where the group admits it
        spec.ssh_port = first.port
        spec.ssh_config = node_ssh_config(first.workdir)  # written by mesh.setup at `up`
    # Storage credentials reach the node only through secrets.env (never run.json or argv).
    spec.secrets.update((storage_credentials(cfg.storage, cfg.train.data) if credentials is None else credentials).env)
    spec.secrets.update(secrets_env or {})  # the user's tokens: the same 0600 secrets.env, nowhere else
    if cluster.budget_hours:  # the cap itself is the node's budget guard, started by `up` (flows/guard.py)
        check_budget_left(cluster, cluster.budget_hours)
    teardown = backend(cluster.provider).self_teardown(cluster) if cfg.teardown == "after-train" else None
    if teardown:
        spec.secrets.update(teardown.env)
        spec.after_run.append(teardown.argv)
    if cluster.runtime == "docker":  # the ranks in the container read secrets.env in the mounted run dir
        from provision.flows.docker import docker_run_for

        spec.launcher_prefix = docker_run_for(cfg, cluster, spec).argv()
    return spec


def start_run(
    cfg: GpuctlConfig,
    cluster: state.ClusterRecord,
    *,
    resume: str | None = None,
    say: Callable[[str], None] = print,
    run_id: str | None = None,
    seed_files: dict[str, str] | None = None,
) -> state.RunRecord:
    """Render, ship to every node, start launch.sh detached on the first; record the run.

    run_id and seed_files (run-dir files shipped with the bundle): a recovered run keeps its id
    and its metrics.jsonl (flows/recover.py)."""
    from provision.core.config import check_batch
    from provision.core.credentials import storage_credentials, user_secrets
    from provision.flows.render import render_bundle
    from provision.flows.resume import check_resume

    if cluster.creating:
        raise GpuctlError(
            f"cluster {cluster.name} is not up: an `up` is creating it or was stopped before it finished",
            "wait for that `gpuctl up`, or run `gpuctl up` again (it replaces a stopped one); `gpuctl down` removes it",
        )
    batch = check_batch(cfg.train, cluster.world_size)
    check_resume(cfg, cluster, resume, say)
    run_id = run_id or new_run_id()
    credentials = storage_credentials(cfg.storage, cfg.train.data)
    if warning := credentials.expiry_warning():
        say(warning)
    spec = bundle_spec(cfg, cluster, run_id, resume, credentials=credentials, secrets_env=user_secrets(cfg.secrets))
    bundle = state.state_dir() / "runs" / run_id
    nodes: list[Node] = []
    try:  # from the first byte of secrets.env: a Ctrl-C, SIGTERM or SIGHUP (core/interrupt.py) still removes it
        nodes = backend(cluster.provider).nodes(cluster)
        remote.warm([] if remote.warming() else nodes)  # SSH: connect as it renders (if `train` did not yet)
        render_bundle(cfg, spec, bundle)
        for name, text in (seed_files or {}).items():
            atomic_write(bundle / name, text)
        remote.warmed()
        if cluster.runtime == "docker":  # a no-op (an ID check) when `up` shipped it already
            from provision.flows.image import ship_cluster

            ship_cluster(cfg, cluster, say, nodes)
        size = sum(f.stat().st_size for f in bundle.rglob("*") if f.is_file())
        say(f"shipping the run bundle ({size / 1e6:,.1f} MB) to {len(nodes)} node(s)")
        for node, rec in zip(nodes[1:], cluster.nodes[1:], strict=True):  # the others have it before the start
            node.put_dir(bundle, run_dir_of(rec.workdir, run_id))
        with ExitStack() as starting:  # once launch.sh starts, the run is recorded before a Ctrl-C lands
            restarts = cfg.recovery.restarts_allowed(bool(getattr(cfg.provider, "interruptible", False)))
            pgid = nodes[0].ship_and_start(bundle, spec.run_dir, "launch.sh", "job.log", starting, restarts)
            record = state.RunRecord(
                run_id=run_id,
                cluster=cluster.name,
                run_dir=spec.run_dir,
                bundle_dir=str(bundle),
                world_size=cluster.world_size,
                train_batch_size=batch,
                micro_batch=cfg.train.micro_batch,
                grad_accum=cfg.train.grad_accum,
                max_steps=cfg.train.max_steps,
                accelerator=cluster.nodes[0].accelerator,
                state="running",
                pgid=pgid,
            )
            state.save_run(record)
    finally:
        (bundle / "secrets.env").unlink(missing_ok=True)  # shipped; no credential stays in the state dir
        for node in nodes:
            node.close()
    say(f"run {run_id} started on {cluster.name}: {cluster.world_size} ranks, batch {batch}")
    return record


@dataclass
class RunStatus:
    """A run as its node reports it; status, summary and last_metrics hold checked values only
    (flows/nodedata.py), notes the warnings about what the node sent that was left out."""

    record: state.RunRecord
    state: str
    exit_code: int | None
    status: dict[str, Any]
    summary: dict[str, Any]
    last_metrics: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    queue: str | None = None  # a batch scheduler's word on the run (provider slurm: PENDING and why)

    def to_json(self) -> dict[str, Any]:
        return {
            "run_id": self.record.run_id,
            "cluster": self.record.cluster,
            "state": self.state,
            "exit_code": self.exit_code,
            "run_dir": self.record.run_dir,
            "world_size": self.record.world_size,
            "train_batch_size": self.record.train_batch_size,
            "steps": self.summary.get("steps", self.last_metrics.get("step")),
            "max_steps": self.record.max_steps,
            "final_loss": self.summary.get("final_loss", self.last_metrics.get("loss")),
            "tokens_per_s": self.summary.get("tokens_per_s", self.last_metrics.get("tokens_per_s")),
            "started_at": self.status.get("started_at"),
            "ended_at": self.status.get("ended_at"),
            "restarts": [event.model_dump() for event in self.record.restarts],
            "queue": self.queue,
        }


def node_of(run: state.RunRecord) -> Node:
    return backend((cluster := state.load_cluster(run.cluster)).provider).nodes(cluster)[0]


def read_status(run: state.RunRecord, node: Node) -> RunStatus:
    notes: list[str] = []
    status = nodedata.read_doc(node, f"{run.run_dir}/status.json", nodedata.NodeStatus, notes)
    summary = nodedata.read_doc(node, f"{run.run_dir}/summary.json", nodedata.NodeSummary, notes)
    tail, _bad = nodedata.parse_lines(nodedata.NodeMetric, [node.last_line(f"{run.run_dir}/metrics.jsonl")])
    run_state = status.get("state", run.state)
    if run_state == "running" and run.pgid and not node.group_alive(run.pgid):
        # It may have ended (and written status.json) since the reads above: read them again.
        status = nodedata.read_doc(node, f"{run.run_dir}/status.json", nodedata.NodeStatus, notes) or status
        summary = nodedata.read_doc(node, f"{run.run_dir}/summary.json", nodedata.NodeSummary, notes) or summary
        run_state = status.get("state", "running")
        if run_state == "running":  # `gpuctl cancel` elsewhere (a queued Slurm job never wrote status.json)
            recorded = state.load_run(run.run_id).state
            run_state = recorded if recorded in TERMINAL else "lost"  # else: killed without writing its end
    if run_state in TERMINAL and run.state == "running" and run.pgid:
        if node.job_over(run.pgid):
            node.drop_run_secrets(run.run_dir)
        else:  # Slurm requeued it: launch.sh starts again
            run_state = "running"
    # The scheduler's word (provider slurm) while the run is open: queued, or how the job ended (TIMEOUT, NODE_FAIL)
    queue = node.queue_state(run.pgid) if run.pgid and run.state == "running" else None
    last = tail[0] if tail else {}
    notes = list(dict.fromkeys(notes))
    result = RunStatus(run, run_state, status.get("exit_code"), status, summary, last, notes, queue)
    if run_state != run.state or result.exit_code != run.exit_code:
        state.update_run(run.run_id, state=run_state, exit_code=result.exit_code)
    return result


def exit_code_of(status: RunStatus) -> int:
    if status.state == "succeeded":
        return 0
    return status.exit_code if status.exit_code not in (None, 0) else 1


class FollowWatch(Protocol):
    """What watches a followed run's node (flows/recover.py): `seen` after each good read,
    `unreachable` while reads fail (it may raise to end the follow: the node is lost)."""

    def seen(self, node: Node) -> None: ...

    def unreachable(self, seconds: float, error: RemoteError) -> None: ...


@dataclass
class Link:
    """The connection to a followed run's node. A failed read closes it, tells the watch, and is
    retried (the next read reconnects) until reconnect_s pass without a good one."""

    run: state.RunRecord
    reconnect_s: float = 300
    watch: FollowWatch | None = None
    node_for: Callable[[state.RunRecord], Node] = node_of
    node: Node | None = None
    last_ok: float = field(default_factory=time.monotonic)

    def read(self, what: Callable[[Node], T]) -> T | None:
        """what(node); None when the node could not be read this time (after a pause)."""
        interrupt.check()  # a Ctrl-C that a finalizer swallowed (core/interrupt.py) still detaches
        try:
            self.node = self.node or self.node_for(self.run)
            got = what(self.node)
            self.last_ok = time.monotonic()
            if self.watch is not None:
                self.watch.seen(self.node)
            return got
        except RemoteError as exc:
            self.close()
            if self.watch is not None:
                self.watch.unreachable(time.monotonic() - self.last_ok, exc)
            if time.monotonic() - self.last_ok > self.reconnect_s:
                raise GpuctlError(
                    f"lost the connection to run {self.run.run_id}: {exc.message}",
                    "check the node, then `gpuctl logs -f` to reattach",
                ) from None
            time.sleep(2)
            return None

    def close(self) -> None:
        if self.node is not None:
            self.node.close()
        self.node = None


def follow(
    run: state.RunRecord,
    out: Callable[[str], None],
    *,
    until_end: bool = True,
    reconnect_s: float = 300,
    watch: FollowWatch | None = None,
    raw: bool = False,
    say: Callable[[str], None] | None = None,
) -> RunStatus:
    """Print job.log from the start, a line at a time, scrubbed of terminal escapes unless `raw`;
    with until_end, keep tailing until the run ends. `say` gets each warning about the node's
    files once (default: out).

    A dropped connection is retried until reconnect_s passes without a successful read.
    """
    log, said = nodedata.Tail(f"{run.run_dir}/job.log"), set()
    queue: str | None = None

    def show(line: str) -> None:
        out(line if raw else nodedata.log_line(line))

    def poll(node: Node) -> RunStatus:
        status = read_status(run, node)  # first: once it is terminal, the log read next is complete
        for note in status.notes:
            if note not in said:
                said.add(note)
                (say or out)(note)
        while True:  # in bounded reads, each printed before the next (Tail keeps the offset)
            for line in log.read(node):
                show(line)
            if not log.more:
                return status

    link = Link(run, reconnect_s, watch)
    try:
        while True:
            status = link.read(poll)
            if status is None:
                continue
            if status.queue and status.queue != queue:
                out(f"gpuctl: {status.queue}")
            queue = status.queue or queue
            if not until_end or status.state in TERMINAL:
                if log.partial:  # a last line without its newline
                    show(log.partial)
                return status
            time.sleep(POLL_S)
    finally:
        link.close()


def cancel(run: state.RunRecord, *, grace_s: float = 20) -> bool:
    """Stop a run through the process group launch.sh recorded. True if it is gone."""
    node = node_of(run)
    try:
        if not run.pgid or not node.group_alive(run.pgid):
            return True
        node.signal_group(run.pgid, "TERM")
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and node.group_alive(run.pgid):
            interrupt.check()
            time.sleep(0.5)
        if node.group_alive(run.pgid):
            node.signal_group(run.pgid, "KILL")
            deadline = time.monotonic() + KILL_REAP_S
            while time.monotonic() < deadline and node.group_alive(run.pgid):
                time.sleep(0.5)
            from provision.flows.docker import remove_container

            remove_container(run, node)  # a killed `docker run` client leaves its container running
        gone = not node.group_alive(run.pgid)
        if gone:
            node.drop_run_secrets(run.run_dir)
    finally:
        node.close()
    if gone:
        state.update_run(run.run_id, state="cancelled" if run.state == "running" else run.state)
    return gone


def fetch_results(run: state.RunRecord, say: Callable[[str], None] = lambda _: None) -> Path:
    """Copy the run's metrics/summary/status from the node into the state dir; return that dir.
    Only checked records are kept (flows/nodedata.py), metrics up to MAX_COPY_BYTES.

    Once the cluster is gone the last fetched copy is what remains (a local run's dir stays).
    """
    results = state.state_dir() / "results" / run.run_id  # named by run id: reports label runs by it
    if state.find_cluster(run.cluster) is None:
        return results if (results / "metrics.jsonl").is_file() else Path(run.run_dir)
    node = node_of(run)
    notes: list[str] = []
    try:
        results.mkdir(parents=True, exist_ok=True)
        for name, model in (("summary.json", nodedata.NodeSummary), ("status.json", nodedata.NodeStatus)):
            doc = nodedata.read_doc(node, f"{run.run_dir}/{name}", model, notes)
            if doc:
                atomic_write(results / name, json.dumps(doc, indent=2) + "\n")
        nodedata.copy_metrics(node, f"{run.run_dir}/metrics.jsonl", results / "metrics.jsonl", notes)
    finally:
        node.close()
    for note in dict.fromkeys(notes):
        say(note)
    return results
