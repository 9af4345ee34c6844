"""train.strategy fsdp: the bundle launches torchrun (templates/torchrun.sh.j2) instead of DeepSpeed's runner.

launch.sh stays the same job script (status.json, job.log, cancel by process group); only the
command it starts differs: `bash torchrun.sh --master_port P`. torchrun.sh holds what the hostfile
holds for DeepSpeed (every node, its slots, the rendezvous address) and starts one torchrun per node.
"""

from __future__ import annotations

import shlex
from typing import Any

from provision.flows.render import BundleSpec

TEMPLATE = "torchrun.sh.j2"
SCRIPT = "torchrun.sh"


def torchrun_context(spec: BundleSpec) -> dict[str, Any]:
    """What launch.sh.j2 and torchrun.sh.j2 need for an fsdp run."""
    script = f"{spec.run_dir}/{SCRIPT}"
    return {
        "launcher": ["bash", script],  # launch.sh appends --master_port "$MASTER_PORT"
        "script": [],
        "torchrun": [*spec.launcher_prefix, spec.python, "-u", "-m", "torch.distributed.run"],
        "trainer_args": ["--module", "trainer", "run.json"],
        "master_addr": spec.master_addr,
        # the command each other node's shell runs (ssh appends the port)
        "remote": [shlex.join(["bash", script, "--node", str(rank)]) for rank in range(1, len(spec.nodes))],
    }
