"""Does the config fit the cluster, as `gpuctl plan` figures it? `up` and `train` refuse one that does not
(`--force` overrides), in one line with plan's closest config that fits (pure computation, no machine).

GPU memory: plan for the cluster's GPUs (the recorded nodes' GPU, else the provider's), when plan knows the
model and the GPU; CPU ranks have no GPU memory to fit. Host RAM and disk: on a renting provider, a
provider.min_ram_gb / disk_gb set below plan's node figures rents hosts the run may not fit (unset, they are
plan's figures; a host's real RAM and disk are the doctor's to check once it is up)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from provision.core.errors import ConfigError
from provision.estimate.hardware import KNOWN_MODELS, PlanError, find_gpu
from provision.estimate.sizing import node_figures, plan_input

if TYPE_CHECKING:
    from provision.core.config import GpuctlConfig
    from provision.core.state import ClusterRecord

OVERRIDE = "or pass --force to go ahead anyway"


def check_fits(cfg: GpuctlConfig, cluster: ClusterRecord) -> None:
    """Raise ConfigError when plan says this config does not fit the cluster (GPU memory, host RAM, disk)."""
    _check_gpu(cfg, cluster)
    _check_host(cfg)


def _check_gpu(cfg: GpuctlConfig, cluster: ClusterRecord) -> None:
    from provision.estimate.plan import plan
    from provision.estimate.plan_input import PlanInput

    fields = plan_input(cfg)
    node = cluster.nodes[0]
    if fields.get("model") not in KNOWN_MODELS or node.accelerator != "cuda":
        return
    gpu = node.gpu_name or fields.get("gpu")  # the node's, else the provider's (ssh before `up`: unknown)
    if not gpu:
        return
    try:
        find_gpu(gpu)
        result = plan(PlanInput(**{**fields, "gpu": gpu, "gpus_per_node": node.slots, "nodes": len(cluster.nodes)}))
    except PlanError:  # a GPU plan does not know: nothing to say
        return
    if result.fits:
        return
    need, have = result.memory.total_gb, result.gpu_capacity_gb
    closest = (
        f"plan's closest config that fits: {', '.join(result.closest_changes)} ({result.closest.memory.total_gb:.1f} GB)"
        if result.closest is not None
        else "nothing fits these GPUs: rent GPUs with more memory, or more of them"
    )
    raise ConfigError(
        f"gpuctl plan: {cfg.train.model} needs {need:.1f} GB per GPU with this config, the {result.gpu.name} "
        f"has {have:g} GB",
        f"{closest}; {OVERRIDE}",
    )


def _check_host(cfg: GpuctlConfig) -> None:
    from provision.core.provider_config import CloudProvider

    prov = cfg.provider
    if not isinstance(prov, CloudProvider):
        return
    req = node_figures(cfg)
    if req is None:
        return
    for key, need, what in (("min_ram_gb", req.ram_gb, "host RAM"), ("disk_gb", req.disk_gb, "disk")):
        have = getattr(prov, key)
        if key in prov.model_fields_set and have < math.ceil(need):
            raise ConfigError(
                f"gpuctl plan: the run needs {math.ceil(need)} GB of {what} per node, provider.{key} rents "
                f"hosts from {have:g} GB",
                f"remove provider.{key} (plan's figure is rented) or set it >= {math.ceil(need)}; {OVERRIDE}",
            )
