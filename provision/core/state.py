"""What clusters and runs exist, on disk, written atomically.

Layout under the state dir (GPUCTL_STATE_DIR, else platformdirs' user state dir):
  clusters/<name>.json   one ClusterRecord per cluster we created or connected to
  runs/<run_id>.json     one RunRecord per run started
  runs/<run_id>/         the rendered bundle as shipped
  lock                   a filelock held while reading-modifying-writing records
  locks/<name>.lock      held by `up` and `down` of that cluster for their whole run
Two gpuctl processes at once are safe: every update takes the lock and replaces the file
with os.replace, so a reader sees the old record or the new one, never half of one.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, Field, ValidationError

from provision.core.checks import DoctorResult
from provision.core.errors import ClusterBusy, ConfigError, NotFoundError, StateError
from provision.core.provider_config import SlurmProvider
from provision.core.ssh_route import SSHRoute
from trainer.objstore.atomic import atomic_write

STATE_ENV = "GPUCTL_STATE_DIR"


class NodeRecord(BaseModel):
    host: str  # the name used in the hostfile
    address: str = "localhost"  # where SSH reaches it
    private_address: str | None = None  # where the other nodes reach it (AWS: inside the VPC)
    port: int = Field(default=22, ge=1, le=65535)
    user: str | None = None
    slots: int = Field(default=1, ge=1, le=1024)
    accelerator: str = "cpu"  # cpu | cuda
    gpu_name: str | None = None
    instance_id: str | None = None
    # The vendor label (Vast label, RunPod name, AWS Name tag) the instance is created under,
    # recorded before the create call: a create whose answer never arrived is found by it.
    label: str | None = None
    host_id: str | None = None  # the vendor's machine behind the instance (recovery avoids a lost one)
    price_per_hour: float | None = None  # this node's share of the cluster's $/h (cloud)
    workdir: str = ""  # the node-side root for run dirs
    install_s: float | None = None  # runtime bootstrap: seconds the node-side install took at `up`
    boot_s: float | None = None  # seconds from `up`'s wait to an SSH login: the vendor's image pull and start
    ssh: SSHRoute | None = None  # ~/.ssh/config: jump hosts, keys, timeouts (ssh provider)


class ClusterRecord(BaseModel):
    name: str
    provider: str
    created_at: float = Field(default_factory=time.time)
    nodes: list[NodeRecord]
    price_per_hour: float | None = None  # all nodes together
    image: str | None = None
    runtime: str = "none"  # none | docker | image | bootstrap
    python: str = "python3"
    identity_file: str | None = None  # SSH private key for the nodes (None: agent / default keys)
    # Cloud providers: where the vendor API is (api_url override, AWS region) so that `down`
    # and self-teardown work from the record alone, without the config.
    api_url: str | None = None
    # RunPod: the container registry auth `up` saved for a private provider.image (its id, no
    # secret); `down` deletes it.
    registry_auth_id: str | None = None
    region: str | None = None
    budget_hours: float | None = None  # the node tears itself down this long after created_at
    doctor: DoctorResult | None = None  # the last `gpuctl doctor` (or `up`'s quick checks)
    # Earlier clusters of a recovered run (flows/recover.py): the budget cap counts across them.
    spent_hours: float = 0.0
    spent_cost: float = 0.0
    # A cloud `up` saves its intent (nodes with their labels) before creating anything and clears
    # this once the cluster is up: a record still creating, with no `up` running, is what a killed
    # `up` left behind; `gpuctl down` (or `sweep`) terminates it, the next `up` replaces it.
    creating: bool = False
    slurm: SlurmProvider | None = None  # provider slurm: login and job shape, so `down` needs no config
    # `up`'s first-step estimate (provision/estimate/startup.py): seconds per phase name, and the
    # line it printed; the first run's summary puts the measured phases beside it.
    startup_estimate: dict[str, float] | None = None
    startup_line: str | None = None

    def rank_nodes(self) -> list[tuple[str, int]]:
        """(host, slots) of each node the ranks run on. Slurm's: placeholders of the job's shape (the one
        record is the login node; Slurm picks the nodes when the job starts, slurm.sh writes the hostfile)."""
        if self.slurm:
            return [(f"node{i}", self.nodes[0].slots) for i in range(self.slurm.nodes)]
        return [(n.host, n.slots) for n in self.nodes]

    @property
    def world_size(self) -> int:
        return sum(slots for _, slots in self.rank_nodes())


class RestartEvent(BaseModel):
    """A run that lost a node and went on on a new one (flows/recover.py)."""

    at: float
    reason: str  # what the vendor said (preempted, gone) or how long the node was unreachable
    old_instance: str  # instance ids, comma-separated on a multi-node cluster
    old_host: str = ""  # the vendor's machine(s) behind them, not rented again for this run
    new_instance: str
    resumed_from: str | None  # "latest" (the store's newest complete checkpoint), None: from the start
    step: int  # the step of that checkpoint
    cost_so_far: float  # $ of every cluster of the run until the loss


class RunRecord(BaseModel):
    run_id: str
    cluster: str
    created_at: float = Field(default_factory=time.time)
    run_dir: str  # on the first node
    bundle_dir: str  # local copy of what was shipped
    world_size: int = Field(ge=1)
    train_batch_size: int = Field(ge=1)
    micro_batch: int = Field(ge=1)
    grad_accum: int = Field(ge=1)
    max_steps: int = Field(ge=0)
    accelerator: str = "cpu"  # cpu | cuda, of the first node
    state: str = "starting"
    exit_code: int | None = None
    pgid: int | None = None
    restarts: list[RestartEvent] = Field(default_factory=list)  # one per lost node, oldest first


def state_dir() -> Path:
    env = os.environ.get(STATE_ENV)
    if env:
        root = Path(env)
    else:
        from platformdirs import user_state_dir

        root = Path(user_state_dir("gpuctl"))
    root.mkdir(parents=True, exist_ok=True)
    return root


@contextmanager
def locked() -> Iterator[Path]:
    from filelock import FileLock

    root = state_dir()
    with FileLock(str(root / "lock"), timeout=60):
        yield root


@contextmanager
def cluster_lock(name: str, action: str) -> Iterator[None]:
    """At most one `up` or `down` of a cluster at a time, across processes. A second one is
    refused at once with one line (a cloud `up` may wait 15 minutes for a node to boot): two
    `up`s would each create instances and the record of one would orphan the other's."""
    from filelock import FileLock, Timeout

    _path("clusters", name)  # the name check
    folder = state_dir() / "locks"
    folder.mkdir(exist_ok=True)
    lock = FileLock(str(folder / f"{name}.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise ClusterBusy(
            f"another gpuctl is running `up` or `down` of cluster {name}; not starting `{action}` as well",
            "wait for it to finish, then `gpuctl status`",
        ) from None
    try:
        yield
    finally:
        lock.release()


KEY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # cluster names, run ids: one file name each
Record = TypeVar("Record", ClusterRecord, RunRecord)


def _path(kind: str, key: str) -> Path:
    if not KEY_RE.match(key):
        what = "cluster name" if kind == "clusters" else "run id"
        raise ConfigError(f"{what} {key!r} is not one gpuctl makes", "see `gpuctl status` for what exists")
    return state_dir() / kind / f"{key}.json"


RENTED = ("vast", "runpod", "aws")  # providers whose cluster record owns paid instances


def raw_record(path: Path) -> dict[str, Any]:
    """What a (maybe damaged) record file still says: its JSON object, else {}."""
    try:
        value = json.loads(path.read_bytes()[: 1 << 20])
    except (OSError, ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


def _damage_fix(path: Path, model: type[BaseModel]) -> str:
    """The fix for a damaged record. A cluster record may own a rented instance: it is never
    "delete it" then (that would orphan the instance), `down` terminates what the vendor lists."""
    if model is RunRecord:
        return "restore the file, or delete it to make gpuctl forget that run (a run record owns no machine)"
    name, provider = path.stem, raw_record(path).get("provider")
    if provider in RENTED:
        return (
            f"restore the file, or `gpuctl down --cluster {name}`: it terminates what {provider} lists for the cluster"
        )
    if isinstance(provider, str) and provider in ("local", "ssh"):
        return "restore the file, or delete it to make gpuctl forget that cluster (it rents no machine)"
    return (
        f"restore the file, or `gpuctl down -c <the cluster's gpuctl.yaml>`: it terminates what the vendor lists "
        f"for cluster {name} (do not delete the file while its instances may run)"
    )


def _read(path: Path, model: type[Record]) -> Record:
    """A record from its file; a damaged one is one line naming the file and the field."""
    try:
        record = model.model_validate_json(path.read_bytes())
    except ValidationError as err:
        first = err.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "(the JSON itself)"
        raise StateError(f"{path}: {field}: {first['msg']}", _damage_fix(path, model)) from None
    if isinstance(record, ClusterRecord) and not record.nodes:  # (`up` builds one node by node; none is saved empty)
        raise StateError(f"{path}: nodes: a cluster has at least one node", _damage_fix(path, model))
    return record


def _save(kind: str, key: str, record: BaseModel) -> None:
    path = _path(kind, key)
    with locked():
        atomic_write(path, record.model_dump_json(indent=2) + "\n")


def save_cluster(record: ClusterRecord) -> None:
    _save("clusters", record.name, record)


def save_run(record: RunRecord) -> None:
    _save("runs", record.run_id, record)


def load_cluster(name: str) -> ClusterRecord:
    path = _path("clusters", name)
    if not path.is_file():
        raise NotFoundError(f"cluster {name!r} is not up", "run `gpuctl up` first")
    return _read(path, ClusterRecord)


def find_cluster(name: str) -> ClusterRecord | None:
    try:
        return load_cluster(name)
    except NotFoundError:
        return None


def cluster_file(name: str) -> Path:
    """Where cluster `name`'s record is (whether or not it exists or loads)."""
    return _path("clusters", name)


def delete_cluster(name: str) -> None:
    path = _path("clusters", name)
    with locked():
        path.unlink(missing_ok=True)


def list_clusters() -> list[ClusterRecord]:
    """The clusters whose records are whole; a damaged one concerns only its own cluster (its
    commands say so), never the others'."""
    folder = state_dir() / "clusters"
    found = []
    for path in sorted(folder.glob("*.json")):
        try:
            found.append(_read(path, ClusterRecord))
        except StateError:
            continue
    return found


@dataclass
class Damaged:
    """A run record that does not load, and the cluster its file still names (None: unreadable)."""

    path: Path
    error: StateError
    cluster: str | None


def scan_runs(cluster: str | None = None) -> tuple[list[RunRecord], list[Damaged]]:
    """The runs (of the cluster, when given), oldest first, and the damaged records that may be
    among them: those naming the cluster, and those too damaged to name one. A damaged record
    that names another cluster is that cluster's business only."""
    runs, damaged = [], []
    for path in (state_dir() / "runs").glob("*.json"):
        try:
            run = _read(path, RunRecord)
        except StateError as err:
            owner = raw_record(path).get("cluster")
            owner = owner if isinstance(owner, str) else None
            if cluster is None or owner in (cluster, None):
                damaged.append(Damaged(path, err, owner))
            continue
        if cluster is None or run.cluster == cluster:
            runs.append(run)
    return sorted(runs, key=lambda r: r.created_at), sorted(damaged, key=lambda d: d.path)


def scan_clusters() -> tuple[list[ClusterRecord], list[str]]:
    """Every readable cluster record, and the names of the damaged ones (one bad file must not
    stop a look over the others, as `gpuctl sweep` takes)."""
    records, damaged = [], []
    for path in sorted((state_dir() / "clusters").glob("*.json")):
        try:
            records.append(_read(path, ClusterRecord))
        except (StateError, OSError, UnicodeDecodeError):
            damaged.append(path.stem)
    return records, damaged


def cluster_busy(name: str) -> bool:
    """An `up` or `down` of the cluster is running now (its lock is held by a live process)."""
    try:
        with cluster_lock(name, "sweep"):
            return False
    except ClusterBusy:
        return True


def list_runs(cluster: str | None = None) -> list[RunRecord]:
    """The runs (of the cluster); a damaged record that names the cluster is an error."""
    runs, damaged = scan_runs(cluster)
    for bad in damaged:
        if cluster is None or bad.cluster == cluster:
            raise bad.error
    return runs


def load_run(run_id: str | None, cluster: str | None = None) -> RunRecord:
    """A run by id, or the newest run (of the cluster, when given)."""
    if run_id:
        path = _path("runs", run_id)
        if not path.is_file():
            raise NotFoundError(f"no run {run_id!r}", "see `gpuctl status` for the runs")
        return _read(path, RunRecord)
    runs = list_runs(cluster)
    if not runs:
        raise NotFoundError("no run yet", "start one with `gpuctl train`")
    return runs[-1]


def update_cluster(name: str, **changes: object) -> ClusterRecord:
    path = _path("clusters", name)
    with locked():
        record = _changed(_read(path, ClusterRecord), changes)
        atomic_write(path, record.model_dump_json(indent=2) + "\n")
    return record


def update_run(run_id: str, **changes: object) -> RunRecord:
    path = _path("runs", run_id)
    with locked():
        record = _changed(_read(path, RunRecord), changes)
        atomic_write(path, record.model_dump_json(indent=2) + "\n")
    return record


def _changed(record: Record, changes: dict[str, object]) -> Record:
    """The record with `changes`, validated like a record read from disk: a value that does not
    fit (a node's exit code "pwn") is refused here, never written to damage the record."""
    return type(record).model_validate({**record.model_dump(), **changes})


def dump(record: BaseModel) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(record.model_dump_json())
    return data
