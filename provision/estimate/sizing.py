"""A gpuctl.yaml as plan input, and the host RAM and disk a rented node needs for it (pure: no machine).

`up` and `offers` rent with `sized_provider(cfg)`: provider.min_ram_gb and disk_gb that gpuctl.yaml leaves
out become plan's node figures (provision.estimate.node), never below the config's defaults (128 GB RAM,
200 GB disk: what a 3-GPU rental has anyway); a model plan does not know keeps the defaults. On a marketplace
(vast, runpod) an unset provider.min_upload_mbps becomes the uplink that stores plan's final checkpoint (the
busiest node's share) within provider.max_final_upload_min.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from provision.estimate.hardware import KNOWN_MODELS, PlanError

if TYPE_CHECKING:
    from provision.core.config import GpuctlConfig
    from provision.core.provider_config import CloudProvider
    from provision.estimate.node_terms import NodeRequirements


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
    from provision.estimate.plan_input import PlanInput

    fields = plan_input(cfg)
    if fields.get("model") not in KNOWN_MODELS:
        return None
    try:
        return node_requirements(PlanInput(**fields))
    except PlanError:
        return None


def final_checkpoint_bytes(cfg: GpuctlConfig) -> int | None:
    """One save on the busiest node (node 0) by plan's figures; None when plan does not know the model or GPU."""
    from provision.estimate.checkpoint_cost import save_bytes
    from provision.estimate.plan import plan
    from provision.estimate.plan_input import PlanInput

    fields = plan_input(cfg)
    if fields.get("model") not in KNOWN_MODELS:
        return None
    try:
        return save_bytes(plan(PlanInput(**fields)), cfg.train.strategy)[0]
    except PlanError:
        return None


def upload_mbps_for(cfg: GpuctlConfig, minutes: float) -> float | None:
    """The host uplink (Mbit/s) that stores the final checkpoint within `minutes`; None: plan cannot say."""
    size = final_checkpoint_bytes(cfg)
    return None if size is None else float(max(1, math.ceil(size * 8 / 1e6 / (minutes * 60))))


# AWS gp3 (EC2 API reference, EbsBlockDevice): 125-1000 MiB/s, 3000-16000 IOPS, at most 0.25 MiB/s per IOPS;
# unset, a root volume gets 125 MiB/s and 3000 IOPS: a 97 GB save would block training ~13 minutes.
GP3_MIBS, GP3_IOPS, GP3_MIBS_PER_IOPS = (125, 1000), (3000, 16000), 0.25
SAVE_WRITE_S = 300  # a save on the node's disk should take at most this long


def gp3_performance(checkpoint_gb: float) -> tuple[int, int]:
    """(MiB/s, IOPS) of a gp3 volume that writes one checkpoint in SAVE_WRITE_S, within gp3's limits."""
    mibs = min(GP3_MIBS[1], max(GP3_MIBS[0], math.ceil(checkpoint_gb * 1e9 / 2**20 / SAVE_WRITE_S)))
    iops = min(GP3_IOPS[1], max(GP3_IOPS[0], math.ceil(mibs / GP3_MIBS_PER_IOPS)))
    return mibs, iops


def sized_provider(cfg: GpuctlConfig) -> CloudProvider:
    """cfg.provider with min_ram_gb and disk_gb raised to plan's figures where gpuctl.yaml leaves them out,
    and a marketplace's min_upload_mbps from plan's final checkpoint."""
    from provision.core.provider_config import CloudProvider, MarketProvider

    prov = cfg.provider
    assert isinstance(prov, CloudProvider)
    uplink = upload_mbps_for(cfg, prov.max_final_upload_min) if isinstance(prov, MarketProvider) else None
    if isinstance(prov, MarketProvider) and prov.min_upload_mbps is None and uplink is not None:
        prov = prov.model_copy(update={"min_upload_mbps": uplink})
    from provision.core.provider_config import AWSProvider

    unset = {"min_ram_gb", "disk_gb"} - prov.model_fields_set
    disk_speed = (
        {"disk_throughput_mbps", "disk_iops"} - prov.model_fields_set if isinstance(prov, AWSProvider) else set()
    )
    req = node_figures(cfg) if unset or disk_speed else None
    if req is None:
        return prov
    figures = {"min_ram_gb": float(math.ceil(req.ram_gb)), "disk_gb": float(math.ceil(req.disk_gb))}
    update = {k: max(v, getattr(prov, k)) for k, v in figures.items() if k in unset}
    speed = dict(zip(("disk_throughput_mbps", "disk_iops"), gp3_performance(req.checkpoint_gb), strict=True))
    return prov.model_copy(update=update | {k: v for k, v in speed.items() if k in disk_speed})


def market_note(cfg: GpuctlConfig, prov: CloudProvider) -> str:
    """Why a marketplace's offers must have this uplink and this driver CUDA, in words."""
    from provision.core.provider_config import IMAGE_CUDA, MarketProvider

    if not isinstance(prov, MarketProvider):
        return ""
    cuda = f"driver CUDA >= {IMAGE_CUDA} (the trainer image is a CUDA {IMAGE_CUDA} build)"
    if prov.min_upload_mbps is None:
        return (
            f"; {cuda}; upload bandwidth not filtered: gpuctl plan does not know {cfg.train.model} "
            "(set provider.min_upload_mbps)"
        )
    if getattr(cfg.provider, "min_upload_mbps", None) is not None:
        why = "provider.min_upload_mbps"
    else:
        size = final_checkpoint_bytes(cfg) or 0
        why = (
            f"the final checkpoint, {size / 1e9:,.1f} GB on node 0 by gpuctl plan, within "
            f"provider.max_final_upload_min {prov.max_final_upload_min:g} min"
        )
    return f"; {cuda}; host upload >= {prov.min_upload_mbps:g} Mbit/s ({why})"


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
            "so these are gpuctl.yaml's values or the defaults" + market_note(cfg, prov)
        )
    plan_ram, plan_disk = math.ceil(req.ram_gb), math.ceil(req.disk_gb)
    ram_from = "provider.min_ram_gb" if "min_ram_gb" in cfg.provider.model_fields_set else "gpuctl plan"
    disk_from = "provider.disk_gb" if "disk_gb" in cfg.provider.model_fields_set else "gpuctl plan"
    return disk_speed_note(prov, req.checkpoint_gb) + (
        f"host RAM >= {prov.min_ram_gb:g} GB ({ram_from}; plan needs {plan_ram} GB: the worst of load, steady, "
        f"save and resume + {req.reserve_gb:g} GB for the OS), disk >= {prov.disk_gb:g} GB ({disk_from}; plan needs "
        f"{plan_disk} GB) for {what}; set provider.min_ram_gb / disk_gb to choose yourself" + market_note(cfg, prov)
    )


def disk_speed_note(prov: CloudProvider, checkpoint_gb: float) -> str:
    """AWS: the root volume's provisioned speed and what it means for one save (empty elsewhere)."""
    mibs, iops = getattr(prov, "disk_throughput_mbps", None), getattr(prov, "disk_iops", None)
    if mibs is None:
        return ""
    minutes = checkpoint_gb * 1e9 / 2**20 / mibs / 60
    default = checkpoint_gb * 1e9 / 2**20 / GP3_MIBS[0] / 60
    return (
        f"root gp3 volume {mibs} MiB/s, {iops} IOPS: a {checkpoint_gb:.1f} GB checkpoint writes in {minutes:.1f} min "
        f"(gp3's default 125 MiB/s: {default:.1f} min; provider.disk_throughput_mbps / disk_iops to choose); "
    )
