"""One node's launcher in a Slurm job: `python -m trainer.slurm_node STRATEGY SLOTS --master_port P ARGS...`.

The batch script (provision/providers/slurm.py) runs launch.sh once, on the job's first node; launch.sh's
launcher is one srun step with one task per node (provision/flows/render.py slurm_launcher), and each task
is this program: it starts its node's ranks with DeepSpeed's per-node launcher (what pdsh runs on each host
for DeepSpeed's own multi-node runner) or torchrun, at the node rank Slurm gave the task (SLURM_NODEID),
with the rendezvous on MASTER_ADDR (the first node's address, from slurm.sh). The ranks' layout comes from
Slurm: the node names from slurm.sh's `scontrol show hostnames`, a GPU node's device ids from the
CUDA_VISIBLE_DEVICES Slurm set for this task (DeepSpeed's launcher would otherwise set 0..SLOTS-1).

Slurm's walltime warning (USR1) reaches every process of the step: this launcher and the one it becomes
ignore it (exec keeps an ignored signal ignored), the ranks catch it and save (trainer/stop_signal.py).
Imports nothing heavy: it becomes the launcher at once.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import sys

from trainer.hostenv import TORCHRUN_OMP

USAGE = "usage: python -m trainer.slurm_node deepspeed|fsdp SLOTS --master_port PORT ARGS..."


def device_ids(env: dict[str, str], slots: int) -> list[int | str]:
    """This node's devices: the ones Slurm gave the task (GPU ranks), else 0..slots-1."""
    visible = env.get("CUDA_VISIBLE_DEVICES", "").strip()
    if env.get("DS_ACCELERATOR") == "cpu" or not visible:
        return list(range(slots))
    ids: list[int | str] = [int(x) if x.isdigit() else x for x in visible.split(",")]
    if len(ids) != slots:
        raise SystemExit(
            f"gpuctl: Slurm gave this node {len(ids)} GPU(s) (CUDA_VISIBLE_DEVICES={visible}), the run needs {slots}"
        )
    return ids


def world_info(hosts: list[str], node_rank: int, slots: int, env: dict[str, str]) -> str:
    """DeepSpeed's --world_info: base64 JSON of {host: [device ids]} in node-rank order. The per-node
    launcher only counts the other nodes' entries (rank offsets); its own entry is its devices."""
    info: dict[str, list[int | str]] = {host: list(range(slots)) for host in hosts}
    info[hosts[node_rank]] = device_ids(env, slots)
    return base64.urlsafe_b64encode(json.dumps(info).encode()).decode()


def launcher(argv: list[str], env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """The argv and environment this task becomes."""
    if len(argv) < 4 or argv[0] not in ("deepspeed", "fsdp") or not argv[1].isdigit() or argv[2] != "--master_port":
        raise SystemExit(USAGE)
    strategy, slots, rest = argv[0], int(argv[1]), argv[2:]
    nodes, node_rank = int(env.get("SLURM_JOB_NUM_NODES", "1")), int(env.get("SLURM_NODEID", "0"))
    hosts = env.get("GPUCTL_SLURM_HOSTS", "").split() or [f"node{i}" for i in range(nodes)]
    if len(hosts) != nodes or not 0 <= node_rank < nodes:
        raise SystemExit(
            f"gpuctl: Slurm's node list {hosts} does not match the job's {nodes} node(s) (node {node_rank})"
        )
    master = env.get("MASTER_ADDR") or hosts[0]
    print(f"gpuctl: node rank {node_rank} on {hosts[node_rank]} starts {slots} rank(s) with {strategy}", flush=True)
    python = [sys.executable, "-u", "-m"]
    if strategy == "deepspeed":
        info = world_info(hosts, node_rank, slots, env)
        head = ["deepspeed.launcher.launch", f"--world_info={info}", f"--node_rank={node_rank}"]
        return [*python, *head, f"--master_addr={master}", "--no_local_rank", *rest], env
    # torchrun sets OMP_NUM_THREADS=1 for several ranks when none is set: mark it, each rank sizes its threads
    marked = env if "OMP_NUM_THREADS" in env else {**env, TORCHRUN_OMP: "1"}
    shape = ["--nnodes", str(nodes), "--node_rank", str(node_rank), "--nproc_per_node", str(slots)]
    return [*python, "torch.distributed.run", *shape, "--master_addr", master, *rest], marked


def main() -> None:
    argv, env = launcher(sys.argv[1:], dict(os.environ))
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    os.execve(argv[0], argv, env)


if __name__ == "__main__":
    main()
