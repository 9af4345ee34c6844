"""`gpuctl doctor` across nodes: one all-reduce over every rank of every node, as the run meets.

Every node already holds the trainer package (flows/doctor.py shipped it to <workdir>/doctor/lib).
Each node runs `python -m trainer.doctor_allreduce` at the same time, from its own thread here:
its ranks take global ranks after the nodes before it and meet at the first node's address (the
private one where the provider has it, as `train` renders --master_addr), on a port picked here.
The rank env of the run (NCCL_*, GLOO_*) goes in the request, so the collective takes the same path.
"""

from __future__ import annotations

import secrets
from concurrent.futures import ThreadPoolExecutor
from itertools import accumulate
from typing import Any

from provision.core import state
from provision.core.checks import CheckRow
from provision.core.config import GpuctlConfig
from provision.core.errors import RemoteError
from provision.estimate.doctor_net import internode_row
from provision.flows.doctor import ALLREDUCE_MB, needs_of, node_argv, remote_facts
from provision.transport.remote import Node

TIMEOUT_S = 600  # torch import and process start on every node, then the rendezvous (120 s at most)
PORTS = (30000, 10000)  # first port, how many to pick from: away from DeepSpeed's 29500


def _requests(cfg: GpuctlConfig, cluster: state.ClusterRecord) -> list[dict[str, Any]]:
    recs = cluster.nodes
    addresses = [r.private_address or r.address for r in recs]
    offsets = [0, *accumulate(r.slots for r in recs)]
    env = needs_of(cfg, cluster, recs[0], quick=False).rank_env
    port = PORTS[0] + secrets.randbelow(PORTS[1])
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


def _one(cfg: GpuctlConfig, cluster: state.ClusterRecord, i: int, node: Node, request: dict[str, Any]) -> Any:
    rec = cluster.nodes[i]
    argv = node_argv(cfg, cluster, rec, f"{rec.workdir.rstrip('/')}/doctor", module="trainer.doctor_allreduce")
    try:
        return remote_facts(node, argv, request, TIMEOUT_S)
    except RemoteError as exc:
        return exc.message[:300]


def internode_check(cfg: GpuctlConfig, cluster: state.ClusterRecord, nodes: list[Node]) -> CheckRow:
    """Start the benchmark on every node at once and judge what they report."""
    requests = _requests(cfg, cluster)
    with ThreadPoolExecutor(max_workers=len(nodes)) as pool:
        futures = [
            pool.submit(_one, cfg, cluster, i, node, req)
            for i, (node, req) in enumerate(zip(nodes, requests, strict=True))
        ]
        facts = [f.result() for f in futures]
    return internode_row([r.host for r in cluster.nodes], facts, cluster.nodes[0].accelerator)
