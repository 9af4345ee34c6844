"""`up`'s first-step estimate for a cloud node: the figures of provision/estimate/startup.py read from the
config, the boot image, the pins and the offer (the model there stays pure; this reads files)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING
from urllib.parse import urlparse

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
    """The run's JIT ops on a GPU node (CPU Adam, for a CPU-offloaded optimizer): none, prebuilt (the
    trainer image has them) or what the run's bucket holds for the pinned software (bucket_has_ops)."""
    if cfg.train.offload_optimizer != "cpu" or cfg.train.strategy == "fsdp":
        return "none"
    return "prebuilt" if runtime == "image" else bucket_has_ops(cfg)


def bucket_has_ops(cfg: GpuctlConfig, op: str = "cpu_adam") -> OpsState:
    """One LIST of the bucket's _ops/ (trainer/opscache.py's layout): an entry for the pinned torch,
    DeepSpeed and CUDA on the portable x86-64-v3 target, any Python (the image's, unknown here), is a
    hit. A store the laptop does not reach (a node-local path, no credentials, no network) is unknown:
    counted as a miss, and the estimate line says it was not checked."""
    from provision.providers.bootstrap import pin_texts

    if urlparse(cfg.storage.url).scheme != "s3":
        return "unknown"  # a path: the node's own disk (node_local), not this laptop's
    texts = pin_texts("cuda")
    torch = re.search(r"^torch==(\S+)", texts["requirements-torch.txt"], re.M)
    cuda = re.search(r"^# cuda: (\S+)", texts["requirements-torch.txt"], re.M)
    ds = re.search(r"^deepspeed==(\S+)", texts["requirements-deepspeed.txt"], re.M)
    if not (torch and cuda and ds):
        return "unknown"
    entry = re.compile(
        rf"_ops/{op}-torch{re.escape(torch[1])}(_[A-Za-z0-9.]+)?-ds{re.escape(ds[1])}-cuda{re.escape(cuda[1])}"
        r"-py\d+\.\d+-x86-64-v3\.json$"
    )
    try:
        from trainer.objstore.store import CheckpointStore

        quick = {"max_attempts": 1, "connect_timeout": 3.0, "read_timeout": 5.0}  # `up` waits for this look
        listed = CheckpointStore.from_config({**cfg.storage_settings(), **quick}).backend.list("_ops/")
    except Exception:  # noqa: BLE001 -- any failure of this look only makes the estimate say "not checked"
        return "unknown"
    return "hit" if any(entry.search(key) for key in listed) else "miss"


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
