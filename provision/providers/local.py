"""Provider `local`: this machine is the node. GPUs when nvidia-smi sees them, else CPU ranks."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable

from provision.core.config import GpuctlConfig
from provision.core.errors import ConfigError
from provision.core.provider_config import LocalProvider
from provision.core.state import ClusterRecord, NodeRecord, state_dir
from provision.providers.base import ProviderBackend, SelfTeardown, UpOptions
from provision.transport.remote import LocalNode, Node

NODE_MODULES = ("torch", "deepspeed", "transformers")
FIND_MODULES = "import importlib.util as u, sys; sys.exit(0 if all(u.find_spec(m) for m in sys.argv[1:]) else 1)"


def visible_gpus() -> list[str]:
    """GPU names from nvidia-smi, without importing torch."""
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (subprocess.SubprocessError, OSError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def node_python(prov: LocalProvider) -> str:
    if not prov.python:
        return sys.executable
    found = shutil.which(prov.python)
    if found is None:  # load_config checks this too; the interpreter may have gone since
        raise ConfigError(f"provider.python: {prov.python} not found", "give a python with torch")
    return found


class LocalBackend(ProviderBackend):
    def up(self, cfg: GpuctlConfig, opts: UpOptions) -> ClusterRecord | None:
        prov = cfg.provider
        assert isinstance(prov, LocalProvider)
        python = node_python(prov)
        missing = subprocess.run([python, "-c", FIND_MODULES, *NODE_MODULES], timeout=60).returncode
        if missing:
            raise ConfigError(
                f"{python} lacks torch/deepspeed/transformers needed to train here",
                "pip install 'gpuctl[train]' (torch first: pip install torch==2.13.0)",
            )
        gpus = visible_gpus()
        if gpus:
            slots, accel = prov.gpus_per_node or len(gpus), "cuda"
            if slots > len(gpus):
                raise ConfigError(
                    f"provider.gpus_per_node is {slots} but this machine has {len(gpus)} GPUs",
                    f"set gpus_per_node to at most {len(gpus)}",
                )
        else:
            slots, accel = prov.cpu_ranks, "cpu"
        node = NodeRecord(
            host="localhost",
            slots=slots,
            accelerator=accel,
            gpu_name=gpus[0] if gpus else None,
            workdir=str(state_dir() / "local-node"),
        )
        record = ClusterRecord(name=cfg.cluster_name, provider="local", nodes=[node], python=python)
        what = f"{slots} x {gpus[0]}" if gpus else f"{slots} CPU ranks (no GPU seen)"
        opts.say(f"local node: {what}")
        return None if opts.dry_run else record

    def nodes(self, cluster: ClusterRecord) -> list[Node]:
        return [LocalNode()]

    def down(self, cluster: ClusterRecord, say: Callable[[str], None]) -> None:
        left = LocalNode().remove_run_secrets(cluster.nodes[0].workdir) if cluster.nodes else 0
        if left:
            say(f"local node: removed {left} run secrets file(s) a killed run left behind")
        say("local node: nothing to terminate")

    def self_teardown(self, cluster: ClusterRecord) -> SelfTeardown | None:
        return None


BACKEND = LocalBackend()
