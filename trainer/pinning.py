"""Pinned host memory for ZeRO-Offload: exact-size, or not at all; never torch's power-of-two rounding.

DeepSpeed pins its offload buffers (fp32 master, fp32 grads, 16-bit staging, one gradient-accumulation
buffer per tensor) through torch (accelerator.pin_memory -> tensor.pin_memory()), whose pinned-host
allocator rounds every block up to a power of two: always in torch 2.10-2.12
(ATen/core/CachingHostAllocator.h l.251 `roundSize = c10::llvm::PowerOf2Ceil(size)`), and in torch 2.13
below `pinned_max_round_threshold_mb`, whose default is "never" (l.302-309; c10/core/AllocatorConfig.h
l.361). A 9.2 GB fp32 partition pins 17.2 GB: DeepSeek-7B on 3 ranks pins 150 GB instead of 86.
- torch >= 2.13: PYTORCH_ALLOC_CONF (and its alias PYTORCH_CUDA_ALLOC_CONF, same value) gets
  pinned_max_round_threshold_mb:1,pinned_max_cached_size_mb:1: blocks above 1 MB are pinned at their size
  and released when freed (DeepSpeed allocates its buffers once); smaller ones are rounded and cached as
  before. The two thresholds are equal on purpose: a round threshold below the cache size is the case of
  torch's heap-overflow fix pytorch#192722.
- older torch (the image's 2.10): ds_config's offload_optimizer.pin_memory is turned off: the same bytes,
  pageable; GPU<->CPU copies of the offload path are then synchronous.
DeepSpeed's own exact allocator (DS_PIN_MEMORY_BACKEND=native, deepspeed/utils/pin_memory.py) is not used:
it mlocks, so it needs RLIMIT_MEMLOCK of ~90 GB (containers default to 8 MB), and a failed mlock hands NULL
to at::from_blob (deepspeed/ops/csrc/pin_memory/deepspeed_pin_tensor.cpp alloc()).
No torch import here: pin_env runs before torch loads.
"""

from __future__ import annotations

import os
import re
from importlib import metadata

EXACT_PIN_TORCH = (2, 13)
PIN_CONF = "pinned_max_round_threshold_mb:1,pinned_max_cached_size_mb:1"
ALLOC_ENV = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def torch_version() -> tuple[int, int] | None:
    try:
        match = re.match(r"(\d+)\.(\d+)", metadata.version("torch"))
    except metadata.PackageNotFoundError:
        return None
    return (int(match.group(1)), int(match.group(2))) if match else None


def exact_pinning(environ: dict[str, str] | None = None, version: tuple[int, int] | None = None) -> bool:
    """Whether torch pins large blocks at their size in this process (torch >= 2.13 and the threshold set)."""
    env = os.environ if environ is None else environ
    version = version or torch_version()
    return (
        version is not None
        and version >= EXACT_PIN_TORCH
        and any("pinned_max_round_threshold_mb" in env.get(k, "") for k in ALLOC_ENV)
    )


def pin_env(environ: dict[str, str] | None = None, version: tuple[int, int] | None = None) -> str | None:
    """Before torch loads, on GPU ranks with torch >= 2.13: add PIN_CONF to the allocator settings.
    Returns the new setting, None when nothing changed (CPU ranks, older torch, or the user set one)."""
    env = os.environ if environ is None else environ
    version = version or torch_version()
    if env.get("DS_ACCELERATOR") == "cpu" or version is None or version < EXACT_PIN_TORCH:
        return None
    current = env.get("PYTORCH_ALLOC_CONF") or env.get("PYTORCH_CUDA_ALLOC_CONF") or ""
    if "pinned_max_round_threshold_mb" in current:
        return None
    merged = ",".join(part for part in (current, PIN_CONF) if part)
    for key in ALLOC_ENV:
        env[key] = merged
    return merged


def pin_offload(device: str, exact: bool) -> bool:
    """Whether host buffers of the offload path are pinned, for either strategy (DeepSpeed's
    offload_optimizer.pin_memory, FSDP2's CPUOffloadPolicy(pin_memory)): on accelerator ranks, and only
    where torch pins exact-size (CPU ranks have nothing to pin for: pinning needs an accelerator)."""
    return device != "cpu" and exact


def settle_pin_memory(ds_config: dict, exact: bool) -> bool:
    """Turn offload_optimizer.pin_memory off when pinning would not be exact-size; True when it did.
    DeepSpeed's default for pin_memory is on, so a block without the key counts as on."""
    zero = ds_config.get("zero_optimization") or {}
    offload = zero.get("offload_optimizer")
    if not isinstance(offload, dict) or offload.get("device") != "cpu" or exact:
        return False
    if offload.get("pin_memory", True) is False:
        return False
    offload["pin_memory"] = False
    return True
