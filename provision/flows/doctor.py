"""`gpuctl doctor` and `up`'s quick checks: run trainer/doctor.py on every node, judge, record.

Per node: ship the trainer package to <workdir>/doctor/lib (the checks script imports torch, so it
runs with the node's python, or in the image under runtime docker), time the node's clock against
this one, send the request on stdin (the storage credentials ride there, never argv or a file),
read back one JSON line of facts, and judge it against what gpuctl.yaml and `gpuctl plan` say
the run needs (provision/estimate/doctor.py). The result goes in the cluster record: `status`
shows it and `train` refuses a node whose checks failed unless --force. A full doctor on several
nodes adds one all-reduce across them all (internode_check, below).
"""

from __future__ import annotations

import json
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable
from itertools import accumulate
from pathlib import Path
from typing import Any

from provision.core import state
from provision.core.checks import CheckRow, DoctorResult
from provision.core.config import GpuctlConfig, TrainConfig
from provision.core.errors import ConfigError, GpuctlError, RemoteError
from provision.core.provider_config import CloudProvider
from provision.estimate.doctor import judge
from provision.estimate.doctor_rows import Needs
from provision.providers import backend
from provision.transport.remote import Node, after_setup

QUICK_TIMEOUT_S = 180  # importing torch and DeepSpeed on a busy node
FULL_TIMEOUT_S = 900  # a first CPU Adam build takes minutes
ALLREDUCE_MB = 32
STORAGE_MB = 64
DISK_MB = {True: 64, False: 512}  # quick (`up`) / full: bytes written + fsync'd for the disk's write rate


def needs_of(cfg: GpuctlConfig, cluster: state.ClusterRecord, node: state.NodeRecord, quick: bool) -> Needs:
    from provision.estimate.sizing import node_figures
    from provision.flows.render import BundleNode, BundleSpec, rank_env

    spec = BundleSpec(
        run_id="doctor",
        run_dir=f"{node.workdir}/doctor",
        nodes=[BundleNode(n.host, n.slots) for n in cluster.nodes],
        python=cluster.python,
        accelerator=node.accelerator,
        gpu_name=node.gpu_name,
    )
    req = node_figures(cfg)
    disk = sum(t.gb for t in req.disk if not t.name.startswith("trainer image")) if req else None
    return Needs(
        ranks=node.slots,
        accelerator=node.accelerator,
        gpu=cfg.provider.gpu if isinstance(cfg.provider, CloudProvider) else None,
        ram_gb=req.ram_gb if req else None,
        disk_gb=disk,
        offload=cfg.train.offload_optimizer == "cpu",
        rank_env=rank_env(cfg, spec),
        runtime=cluster.runtime,
        quick=quick,
    )


def rates_request(train: TrainConfig, world: int) -> dict[str, Any] | None:
    """What trainer.doctor_rates times for the step-time model: the run's model shape (when plan knows it),
    batch geometry and precision, and a rank's share of the parameters for CPU Adam."""
    import dataclasses

    from provision.estimate.hardware import KNOWN_MODELS

    dims = KNOWN_MODELS.get(train.model)
    if dims is None:
        return None
    return {
        "model": {k: v for k, v in dataclasses.asdict(dims).items() if k != "name"},
        "micro_batch": train.micro_batch,
        "seq_len": train.seq_len,
        "precision": train.precision,
        "checkpointing": train.gradient_checkpointing,
        "zero_stage": train.zero_stage,
        "strategy": train.strategy,
        "adam_params": -(-dims.params // world) if train.offload_optimizer == "cpu" else None,
    }


def _request(cfg: GpuctlConfig, node: state.NodeRecord, needs: Needs, quick: bool, world: int = 1) -> dict[str, Any]:
    return {
        "quick": quick,
        "ranks": node.slots,
        "accelerator": node.accelerator,
        "workdir": node.workdir,
        "offload": needs.offload,
        "storage": cfg.storage_settings(for_node=True),
        "env": needs.rank_env,
        "allreduce_mb": ALLREDUCE_MB,
        "storage_mb": STORAGE_MB,
        "disk_mb": DISK_MB[quick],
        "rates": None if quick else rates_request(cfg.train, world),
    }


def node_argv(
    cfg: GpuctlConfig, cluster: state.ClusterRecord, node: state.NodeRecord, folder: str, module: str = "trainer.doctor"
) -> list[str]:
    """python -m MODULE with the shipped package first on the path; in the image under runtime docker."""
    if cluster.runtime == "docker":
        from provision.flows.docker import DockerRun
        from provision.providers.base import DEFAULT_IMAGE, IMAGE_PYTHON

        cache = f"{node.workdir.rstrip('/')}/cache"
        run = DockerRun(
            image=cluster.image or DEFAULT_IMAGE,
            run_dir=folder,
            name=f"gpuctl-doctor-{secrets.token_hex(3)}",
            gpus=node.accelerator == "cuda",  # a broken NVIDIA container runtime fails right here
            shm_size=cfg.docker.shm_size,
            ulimits=list(cfg.docker.ulimits),
            cache_dir=cache,
            mounts=list(cfg.docker.mounts),
            env_values={"PYTHONPATH": f"{folder}/lib", "TORCH_EXTENSIONS_DIR": f"{cache}/torch_extensions"},
            extra_args=["-i", *cfg.docker.run_args],
        )
        return [*run.argv(), IMAGE_PYTHON, "-m", module]
    argv = ["env", f"PYTHONPATH={folder}/lib", cluster.python, "-m", module]
    return after_setup(getattr(cfg.provider, "setup", None), argv)


def clock_offset(node: Node) -> tuple[float, float] | None:
    """(node clock - this clock, half the round trip) in seconds; None when `date` gives no number."""
    before = time.time()
    out = node.sh("date +%s.%N", timeout=30, check=False).stdout.strip()
    after = time.time()
    try:
        return float(out) - (before + after) / 2, (after - before) / 2
    except ValueError:
        return None


def remote_facts(node: Node, argv: list[str], request: dict[str, Any], timeout: float) -> dict[str, Any]:
    result = node.run(argv, check=False, timeout=timeout, stdin=json.dumps(request).encode())
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.rc != 0 or not lines:
        detail = (result.stderr.strip() or result.stdout.strip() or f"exit {result.rc}").splitlines()
        raise RemoteError(f"the checks script exited {result.rc}: {detail[-1][:300] if detail else ''}")
    try:
        facts = json.loads(lines[-1])
    except json.JSONDecodeError as exc:
        raise RemoteError(f"the checks script printed no JSON ({exc})") from None
    if not isinstance(facts, dict):
        raise RemoteError("the checks script printed JSON that is no object")
    return facts


def _ship(staging: Path) -> None:
    import trainer  # the package folder only; the laptop never imports its torch modules

    source = Path(trainer.__file__).resolve().parent
    shutil.copytree(source, staging / "lib" / "trainer", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


def check_node(
    cfg: GpuctlConfig,
    cluster: state.ClusterRecord,
    rec: state.NodeRecord,
    node: Node,
    staging: Path,
    quick: bool,
    rates: dict[str, Any] | None = None,
) -> list[CheckRow]:
    """The node's rows; with `rates`, also the step-time model's figures it measured, under its host."""
    from provision.core.credentials import storage_credentials

    needs = needs_of(cfg, cluster, rec, quick)
    folder = f"{rec.workdir.rstrip('/')}/doctor"
    request = _request(cfg, rec, needs, quick, sum(n.slots for n in cluster.nodes))
    try:  # the run's own credentials, resolved here as `train` resolves them
        request["storage_env"] = storage_credentials(cfg.storage, cfg.train.data).env
        no_credentials = None
    except GpuctlError as exc:  # the storage row says so; every other check still runs
        request["storage"], no_credentials = None, {"url": cfg.storage_url(), "error": exc.one_line()}
    try:
        node.put_dir(staging, folder)
        offset = clock_offset(node)
        timeout = QUICK_TIMEOUT_S if quick else FULL_TIMEOUT_S
        argv = node.on_compute(node_argv(cfg, cluster, rec, folder), timeout)  # slurm: a short job on the partition
        facts = remote_facts(node, argv, request, timeout)
    except RemoteError as exc:
        fix = (
            "check provider.python on the node: `gpuctl ssh` and run `PYTHON -m trainer.doctor` in <workdir>/doctor/lib"
        )
        if cluster.runtime == "docker":
            fix = "check `docker run --gpus all IMAGE nvidia-smi` on the node (the NVIDIA container toolkit) and the image"
        return [
            CheckRow(check="doctor", node=rec.host, value=exc.message[:300], expected="runs", status="fail", fix=fix)
        ]
    if no_credentials:
        facts["storage"] = no_credentials
    if rates is not None:
        from provision.estimate.doctor_speed import raw_rates

        rates[rec.host] = raw_rates(facts)
    return judge(rec.host, facts, needs, offset)


# --- across nodes: one all-reduce over every rank of every node, as the run meets -----------------------
# Every node already holds the trainer package (run_checks shipped it to <workdir>/doctor/lib). Each node runs
# `python -m trainer.doctor_allreduce` at the same time, from its own thread here: its ranks take global ranks
# after the nodes before it and meet at the first node's address (the private one where the provider has it, as
# `train` renders --master_addr), on a port picked here. The rank env of the run (NCCL_*, GLOO_*) goes in the
# request, so the collective takes the same path.
INTERNODE_TIMEOUT_S = 600  # torch import and process start on every node, then the rendezvous (120 s at most)
INTERNODE_PORTS = (30000, 10000)  # first port, how many to pick from: away from DeepSpeed's 29500


def _internode_requests(cfg: GpuctlConfig, cluster: state.ClusterRecord) -> list[dict[str, Any]]:
    recs = cluster.nodes
    addresses = [r.private_address or r.address for r in recs]
    offsets = [0, *accumulate(r.slots for r in recs)]
    env = needs_of(cfg, cluster, recs[0], quick=False).rank_env
    port = INTERNODE_PORTS[0] + secrets.randbelow(INTERNODE_PORTS[1])
    return [
        {
            "env": env,
            "ranks": rec.slots,
            "rank_offset": offsets[i],
            "world": offsets[-1],
            "master_addr": addresses[0],
            "master_port": port,
            "peer": addresses[1] if i == 0 else addresses[0],  # the link the ring's inter-node hop takes
            "accelerator": rec.accelerator,
            "allreduce_mb": ALLREDUCE_MB,
        }
        for i, rec in enumerate(recs)
    ]


def _internode_one(cfg: GpuctlConfig, cluster: state.ClusterRecord, i: int, node: Node, request: dict[str, Any]) -> Any:
    rec = cluster.nodes[i]
    argv = node_argv(cfg, cluster, rec, f"{rec.workdir.rstrip('/')}/doctor", module="trainer.doctor_allreduce")
    try:
        return remote_facts(node, argv, request, INTERNODE_TIMEOUT_S)
    except RemoteError as exc:
        return exc.message[:300]


def internode_check(cfg: GpuctlConfig, cluster: state.ClusterRecord, nodes: list[Node]) -> CheckRow:
    """Start the benchmark on every node at once and judge what they report."""
    from concurrent.futures import ThreadPoolExecutor

    from provision.estimate.doctor_net import internode_row

    requests = _internode_requests(cfg, cluster)
    with ThreadPoolExecutor(max_workers=len(nodes)) as pool:
        futures = [
            pool.submit(_internode_one, cfg, cluster, i, node, req)
            for i, (node, req) in enumerate(zip(nodes, requests, strict=True))
        ]
        facts = [f.result() for f in futures]
    return internode_row([r.host for r in cluster.nodes], facts, cluster.nodes[0].accelerator)


def run_checks(
    cfg: GpuctlConfig, cluster: state.ClusterRecord, *, quick: bool, say: Callable[[str], None] = print
) -> DoctorResult:
    """Check every node of the cluster; record and return the result."""
    if cfg.cluster_name != cluster.name:
        raise ConfigError(
            f"gpuctl.yaml is for cluster {cfg.cluster_name}, not {cluster.name}", "pass -c for its config"
        )
    say(f"checking {len(cluster.nodes)} node(s) of {cluster.name}" + (" (quick)" if quick else ""))
    nodes = backend(cluster.provider).nodes(cluster)
    rows: list[CheckRow] = []
    rates: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="gpuctl-doctor-") as tmp:
        _ship(Path(tmp))
        try:
            for rec, node in zip(cluster.nodes, nodes, strict=True):
                rows += check_node(cfg, cluster, rec, node, Path(tmp), quick, rates)
            if not quick and len(nodes) > 1:  # the package is on every node now
                say(f"all-reduce across {len(nodes)} nodes")
                rows.append(internode_check(cfg, cluster, nodes))
        finally:
            for node in nodes:
                node.close()
    previous = cluster.doctor.rates if cluster.doctor is not None else {}
    if quick:  # `up`'s quick checks measure the disk only: a full doctor's other figures stay
        rates = {host: {**previous.get(host, {}), **mine} for host, mine in rates.items()}
    result = DoctorResult(quick=quick, rows=rows, rates=rates)
    state.update_cluster(cluster.name, doctor=result)
    return result


def refuse_failed(cluster: state.ClusterRecord) -> None:
    """`train` on a node whose last checks failed: one line naming them, and the ways on."""
    from provision.core.errors import GpuctlError

    failing = cluster.doctor.failing() if cluster.doctor else []
    if failing:
        what = "; ".join(f"{r.node}: {r.check} ({r.value})" for r in failing[:3])
        raise GpuctlError(
            f"cluster {cluster.name} failed its checks: {what}",
            "fix what `gpuctl doctor` shows and run it again, or `gpuctl train --force`",
        )
