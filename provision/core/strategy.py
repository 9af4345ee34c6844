"""train.strategy: which engine trains (DeepSpeed or PyTorch FSDP2), and the keys only one of them reads.

config.py holds the field; this module holds what a strategy allows, so a DeepSpeed-only key set
with strategy fsdp is one clear error naming the key instead of a value the run silently ignores.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from provision.core.config import TrainConfig

Strategy = Literal["deepspeed", "fsdp"]
STRATEGIES: tuple[str, ...] = ("deepspeed", "fsdp")

# train keys only DeepSpeed reads (ds_config.json): with strategy fsdp, setting one is an error.
DEEPSPEED_ONLY = {
    "zero_stage": "FSDP always shards parameters, gradients and optimizer state (ZeRO-3's layout)",
    "tensorboard": "the TensorBoard monitor is DeepSpeed's; FSDP runs log metrics.jsonl",
}


def check_strategy(train: TrainConfig) -> None:
    """Raise ValueError (pydantic shows it against `train`) for a key the chosen strategy cannot honour."""
    if train.strategy != "fsdp":
        return
    defaults = type(train).model_fields
    for key, why in DEEPSPEED_ONLY.items():  # the init template's defaults (zero_stage 2, tensorboard false) pass
        if key in train.model_fields_set and getattr(train, key) != defaults[key].default:
            raise ValueError(f"{key} is a DeepSpeed-only key and strategy is fsdp ({why}); remove {key}")
    if train.precision == "fp16":
        raise ValueError(
            "precision fp16 needs a loss scaler, which gpuctl runs only with DeepSpeed; "
            "with strategy fsdp use bf16 (or fp32)"
        )
