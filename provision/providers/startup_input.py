"""`up`'s first-step estimate for a cloud node: the figures of provision/estimate/startup.py read from the
config, the boot image, the pins and the offer (the model there stays pure; this reads files)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from provision.estimate.hardware import KNOWN_MODELS
from provision.estimate.startup import OpsState, StartupInput, Term, first_step
from provision.estimate.wheel_sizes import SDISTS, install_mb

if TYPE_CHECKING:
    from provision.core.config import GpuctlConfig

CHECKPOINT_BYTES = 2  # bytes per parameter of the Hub's weights: DeepSeek's and Llama's are bf16


def model_bytes(model: str) -> float:
    """The weights a run downloads: the built-in tiny model and a local folder none; a known Hub model
    its parameter count x CHECKPOINT_BYTES; another one 0 (its size unknown here)."""
    dims = KNOWN_MODELS.get(model)
    if model == "tiny" or dims is None or model.startswith(("/", ".", "~")):
        return 0.0
    return float(dims.params * CHECKPOINT_BYTES)


def ops_state(cfg: GpuctlConfig, runtime: str) -> OpsState:
    """The run's JIT ops: none (no CPU-offloaded optimizer), prebuilt (the trainer image has them) or
    the op cache's answer; the bucket is not looked at from here (its key needs the node's torch, CUDA
    and Python): unknown, counted as a miss."""
    if cfg.train.offload_optimizer != "cpu" or cfg.train.strategy == "fsdp":
        return "none"
    return "prebuilt" if runtime == "image" else "unknown"


def startup_terms(cfg: GpuctlConfig, runtime: str, image: str | None, download_mbps: float | None) -> list[Term]:
    from provision.providers.bootstrap import pin_texts
    from provision.providers.vendor_images import IMAGE_SIZES

    size = IMAGE_SIZES.get(image or "")
    wheels, builds = 0.0, 0
    if runtime == "bootstrap":
        wheels, _unknown = install_mb(list(pin_texts("cuda").values()))
        builds = len(SDISTS)
    inp = StartupInput(
        image_gb=size[0] if size else None,
        wheels_mb=wheels,
        sdist_builds=builds,
        ops=ops_state(cfg, runtime),
        model_bytes=model_bytes(cfg.train.model),
        download_mbps=download_mbps,
    )
    return first_step(inp)
