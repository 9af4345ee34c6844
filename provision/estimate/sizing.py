"""A gpuctl.yaml as plan input, and the host RAM and disk a rented node needs for it (pure: no machine).

`up` and `offers` rent with `sized_provider(cfg)`: provider.min_ram_gb and disk_gb that gpuctl.yaml leaves
out become plan's node figures (provision.estimate.node), never below the config's defaults (128 GB RAM,
200 GB disk: what a 3-GPU rental has anyway); a model plan does not know keeps the defaults.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from provision.estimate.hardware import KNOWN_MODELS, PlanError

if TYPE_CHECKING:
    from provision.core.config import GpuctlConfig
    from provision.core.provider_config import CloudProvider
    from provision.estimate.node import NodeRequirements


def plan_input(cfg: GpuctlConfig | None) -> dict[str, Any]:
    """The run's own gpuctl.yaml as PlanInput fields; {} (DeepSeek-7B on 3x RTX 4090) without one."""
    if cfg is None:
        return {}
    from provision.core.provider_config import CloudProvider

    prov, train = cfg.provider, cfg.train
    gpus = getattr(prov, "gpus_per_node", None) or getattr(prov, "cpu_ranks", None) or 1
    out: dict[str, Any] = dict(
        model=train.model,
        gpus_per_node=gpus,
        nodes=getattr(prov, "nodes", None) or len(getattr(prov, "hosts", []) or [1]),
        zero_stage=train.zero_stage,
        offload_optimizer=train.offload_optimizer,
        micro_batch=train.micro_batch,
        seq_len=train.seq_len,
        gradient_checkpointing=train.gradient_checkpointing,
        precision=train.precision,
        grad_accum=train.grad_accum,
        keep_local=train.keep_local,
        strategy=train.strategy,
    )
    data = cfg.data_path()
    if data is not None and data.is_file():
        out["data_bytes"] = data.stat().st_size
    if isinstance(prov, CloudProvider) and prov.gpu:
        out["gpu"] = prov.gpu
    return out


def node_figures(cfg: GpuctlConfig) -> NodeRequirements | None:
    """Plan's node requirements for this config; None when plan does not know the model or GPU."""
    from provision.estimate.node import node_requirements
    from provision.estimate.plan import PlanInput

    fields = plan_input(cfg)
    if fields.get("model") not in KNOWN_MODELS:
        return None
    try:
        return node_requirements(PlanInput(**fields))
    except PlanError:
        return None


def sized_provider(cfg: GpuctlConfig) -> CloudProvider:
    """cfg.provider with min_ram_gb and disk_gb raised to plan's figures where gpuctl.yaml leaves them out."""
    from provision.core.provider_config import CloudProvider

    prov = cfg.provider
    assert isinstance(prov, CloudProvider)
    unset = {"min_ram_gb", "disk_gb"} - prov.model_fields_set
    req = node_figures(cfg) if unset else None
    if req is None:
        return prov
    figures = {"min_ram_gb": float(math.ceil(req.ram_gb)), "disk_gb": float(math.ceil(req.disk_gb))}
    return prov.model_copy(update={k: max(v, getattr(prov, k)) for k, v in figures.items() if k in unset})


def sizing_note(cfg: GpuctlConfig, prov: CloudProvider) -> str:
    """Why the offer filters ask for this much host RAM and disk: plan's figures, or the user's word."""
    import math

    req = node_figures(cfg)
    train = cfg.train
    what = (
        f"{train.model}, ZeRO-{train.zero_stage}, offload {train.offload_optimizer}, {train.precision}, "
        f"{prov.gpus_per_node} GPUs per node"
    )
    if req is None:
        return (
            f"host RAM >= {prov.min_ram_gb:g} GB, disk >= {prov.disk_gb:g} GB: gpuctl plan does not know {train.model}, "
            "so these are gpuctl.yaml's values or the defaults"
        )
    plan_ram, plan_disk = math.ceil(req.ram_gb), math.ceil(req.disk_gb)
    ram_from = "provider.min_ram_gb" if "min_ram_gb" in cfg.provider.model_fields_set else "gpuctl plan"
    disk_from = "provider.disk_gb" if "disk_gb" in cfg.provider.model_fields_set else "gpuctl plan"
    return (
        f"host RAM >= {prov.min_ram_gb:g} GB ({ram_from}; plan needs {plan_ram} GB: the worst of load, steady, "
        f"save and resume + {req.reserve_gb:g} GB for the OS), disk >= {prov.disk_gb:g} GB ({disk_from}; plan needs "
        f"{plan_disk} GB) for {what}; set provider.min_ram_gb / disk_gb to choose yourself"
    )
