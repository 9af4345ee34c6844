"""The model: a tiny DeepSeek-shaped Llama built here, or any causal LM from HF / a local path."""

from __future__ import annotations

import torch
import transformers
from packaging.version import Version
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from trainer.config import TrainConfig, TrainerError

# DeepSeek-7B (deepseek-ai/deepseek-llm-7b-base) scaled down: same architecture (Llama: RoPE,
# RMSNorm, SwiGLU, untied embeddings, no biases, no dropout) and the same FFN ratio
# 11008 / 4096 = 2.6875, so 128 * 2.6875 = 344.
TINY_SHAPE = {
    "hidden_size": 128,
    "intermediate_size": 344,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "mlp_bias": False,
}

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def tiny_model(vocab_size: int, seq_len: int, seed: int, special_ids: dict[str, int]) -> LlamaForCausalLM:
    """Same seed -> bit-identical weights on every rank (built on CPU in fp32)."""
    config = LlamaConfig(
        vocab_size=vocab_size, max_position_embeddings=max(seq_len, 2048), use_cache=False, **special_ids, **TINY_SHAPE
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
    return model


def pretrained_model(source: str, dtype: torch.dtype) -> torch.nn.Module:
    """Load directly in the training dtype so no fp32 copy is held per rank."""
    dtype_key = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
    try:
        return AutoModelForCausalLM.from_pretrained(
            source, attn_implementation="sdpa", low_cpu_mem_usage=True, **{dtype_key: dtype}
        )
    except OSError as exc:
        raise TrainerError(f"cannot load model {source!r}: {exc}".splitlines()[0]) from None


def build_model(train: TrainConfig, precision: str, tokenizer) -> torch.nn.Module:
    if train.model == "tiny":
        special = {
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        }
        model = tiny_model(len(tokenizer), train.seq_len, train.seed, special)
    else:
        model = pretrained_model(train.model, DTYPES[precision])
        if model.get_input_embeddings().num_embeddings < len(tokenizer):
            raise TrainerError(
                f"tokenizer has {len(tokenizer)} tokens but the model's embedding has "
                f"{model.get_input_embeddings().num_embeddings}; pick a matching train.tokenizer"
            )
    model.config.use_cache = False
    if train.gradient_checkpointing:
        # transformers >= 5 renamed it activation_checkpointing_enable (the old name warns).
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable({"use_reentrant": False})  # first parameter of both: the checkpoint kwargs
    return model


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
