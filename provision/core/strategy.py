"""train.strategy: which engine trains (DeepSpeed or PyTorch FSDP2), and the keys only one of them reads.

config.py holds the field; this module holds what a strategy allows, so a DeepSpeed-only key set
with strategy fsdp is one clear error naming the key instead of a value the run silently ignores.
It is told the train section's values, not handed the section, so the import runs one way
(config.py -> strategy.py).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Literal

Strategy = Literal["deepspeed", "fsdp"]
STRATEGIES: tuple[str, ...] = ("deepspeed", "fsdp")

# train keys only DeepSpeed reads (ds_config.json): with strategy fsdp, setting one is an error.
DEEPSPEED_ONLY = {
    "zero_stage": "FSDP always shards parameters, gradients and optimizer state (ZeRO-3's layout)",
    "tensorboard": "the TensorBoard monitor is DeepSpeed's; FSDP runs log metrics.jsonl",
}


def check_strategy(strategy: str, precision: str, changed: Collection[str]) -> None:
    """Raise ValueError (pydantic shows it against `train`) for a key the chosen strategy cannot honour.
    `changed`: the train keys the user set to a value other than the default (the init template's
    defaults, zero_stage 2 and tensorboard false, pass)."""
    if strategy != "fsdp":
        return
    for key, why in DEEPSPEED_ONLY.items():
        if key in changed:
            raise ValueError(f"{key} is a DeepSpeed-only key and strategy is fsdp ({why}); remove {key}")
    if precision == "fp16":
        raise ValueError(
            "precision fp16 needs a loss scaler, which gpuctl runs only with DeepSpeed; "
            "with strategy fsdp use bf16 (or fp32)"
        )
