"""A ZeRO or FSDP (DCP) checkpoint -> a Hugging Face model folder (`gpuctl ckpt pull --hf DIR` runs this).

    python -m trainer.export CKPT_ROOT TAG OUT_DIR --model MODEL [--tokenizer TOK] [--dtype fp32]

CKPT_ROOT is a DeepSpeed save dir holding TAG/ (the per-rank ZeRO shards). DeepSpeed's
zero_to_fp32 merges the shards into one fp32 state dict; the model is built the way the
trainer builds it (`tiny`: trainer.model's DeepSeek-shaped Llama; otherwise the HF id or
folder's config, without downloading its weights), the state dict is loaded strictly (a
missing or extra tensor is an error), and model + tokenizer are written with save_pretrained
(safetensors), so AutoModelForCausalLM / AutoTokenizer.from_pretrained(OUT_DIR) load it
offline. The checkpoint's trainer_state.json says which model it trained; --model must agree.

The checkpoint came from a node, so nothing in it is unpickled freely (trainer/safe_load.py): every
torch.load here is weights-only with DeepSpeed's few classes allowed, each shard is checked for other
globals before any loads, and DCP's .metadata goes through a restricted unpickler.

Exit codes: 0 written, 2 a known problem, 3 a checkpoint refused as unsafe (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from trainer.checkpoint import STATE_FILE
from trainer.config import TrainConfig, TrainerError
from trainer.safe_load import UnsafeCheckpoint

DTYPES = ("fp32", "bf16", "fp16")
MAX_STATE = 1 << 20  # bytes of trainer_state.json (a few fields)
MAX_SEQ_LEN = 1 << 20


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m trainer.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("ckpt_root", type=Path, help="DeepSpeed save dir holding TAG/")
    parser.add_argument("tag", help="checkpoint tag, e.g. step30")
    parser.add_argument("out_dir", type=Path, help="Hugging Face model folder to write")
    parser.add_argument("--model", help="'tiny', an HF id or a folder (default: what the checkpoint recorded)")
    parser.add_argument("--tokenizer", help="tokenizer id or folder (default: the model's own)")
    parser.add_argument("--dtype", choices=DTYPES, default="fp32", help="weights dtype to save (default fp32)")
    return parser.parse_args(argv)


def recorded_state(tag_dir: Path) -> dict:
    path = tag_dir / STATE_FILE
    if not tag_dir.is_dir():
        raise TrainerError(f"checkpoint {tag_dir} does not exist")
    if not path.is_file():
        return {}
    with path.open("rb") as fh:
        raw = fh.read(MAX_STATE + 1)
    try:
        state = json.loads(raw) if len(raw) <= MAX_STATE else None
    except ValueError:  # not JSON, or not UTF-8
        state = None
    if not isinstance(state, dict):
        raise TrainerError(f"{path} is not a JSON object of at most {MAX_STATE >> 20} MiB")
    return state


def log(message: str) -> None:
    print(f"export: {message}", file=sys.stderr, flush=True)


def train_config(args: argparse.Namespace, state: dict) -> TrainConfig:
    """The model/tokenizer to rebuild: the flags, checked against what the checkpoint recorded."""
    recorded = state.get("model")
    model = args.model or recorded
    if model is None:
        raise TrainerError(f"checkpoint {args.tag} does not record its model; pass --model")
    if recorded is not None and model != recorded:  # e.g. a node-local path vs the laptop's copy
        log(f"warning: checkpoint {args.tag} was trained from model {recorded!r}; building {model!r}")
    tokenizer = args.tokenizer if args.tokenizer is not None else state.get("tokenizer")
    seq_len = state.get("seq_len", 128)
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or not 0 < seq_len <= MAX_SEQ_LEN:
        raise TrainerError(
            f"checkpoint {args.tag}: seq_len {str(seq_len)[:40]!r} is not an integer in 1..{MAX_SEQ_LEN}"
        )
    for what, value in (("model", model), ("tokenizer", tokenizer)):
        if value is not None and not isinstance(value, str):
            raise TrainerError(f"checkpoint {args.tag}: its {what} is {type(value).__name__}, not text; pass --{what}")
    return TrainConfig(model=model, tokenizer=tokenizer, seq_len=seq_len)


def build(train: TrainConfig, tokenizer):
    """An fp32 model of the trained architecture (its weights get replaced)."""
    import torch

    from trainer.model import build_model

    if train.model == "tiny":
        return build_model(train, "fp32", tokenizer)
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(train.model)
    except OSError as exc:
        raise TrainerError(f"cannot load the config of model {train.model!r}: {exc}".splitlines()[0]) from None
    import transformers
    from packaging.version import Version

    dtype_key = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
    return AutoModelForCausalLM.from_config(config, **{dtype_key: torch.float32})


def export(args: argparse.Namespace) -> Path:
    import inspect

    import torch

    from trainer.fsdp_export import is_dcp_checkpoint, load_dcp_weights
    from trainer.safe_load import guard_torch_load
    from trainer.tokenizer import load_tokenizer

    guard_torch_load()  # before anything reads the checkpoint
    state = recorded_state(args.ckpt_root / args.tag)
    train = train_config(args, state)
    tokenizer = load_tokenizer(train)
    model = build(train, tokenizer)
    tag_dir = args.ckpt_root / args.tag
    if is_dcp_checkpoint(tag_dir):  # train.strategy fsdp: torch.distributed.checkpoint shards
        log(f"consolidating the FSDP (DCP) shards of {args.tag} (saved by {state.get('world_size', '?')} ranks)")
        load_dcp_weights(model, tag_dir, args.tag, train.model)
    else:
        log(f"merging the ZeRO shards of {args.tag} (saved by {state.get('world_size', '?')} ranks)")
        weights = merge_zero_shards(args.ckpt_root, args.tag)
        try:
            model.load_state_dict(weights, strict=True)
        except RuntimeError as exc:
            first = str(exc).splitlines()[0:2]
            raise TrainerError(f"checkpoint {args.tag} does not fit model {train.model!r}: {' '.join(first)}") from None
    if args.dtype != "fp32":
        model = model.to({"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype])
    model.config.use_cache = True  # off while training; generation wants it
    args.out_dir.mkdir(parents=True, exist_ok=True)
    # safetensors: the only format of transformers >= 5, an option before
    safe = (
        {"safe_serialization": True}
        if "safe_serialization" in inspect.signature(model.save_pretrained).parameters
        else {}
    )
    model.save_pretrained(args.out_dir, **safe)
    tokenizer.save_pretrained(args.out_dir)
    log(
        f"wrote {train.model} at {args.tag} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, "
        f"{args.dtype}) to {args.out_dir}"
    )
    return args.out_dir


def merge_zero_shards(ckpt_root: Path, tag: str) -> dict:
    """zero_to_fp32's state dict; its torch.loads are weights-only (guard_torch_load), and each shard
    is checked first so a refusal names the file."""
    import pickle
    import re

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from trainer.safe_load import check_torch_files, refusal

    check_torch_files(ckpt_root / tag, tag)
    try:
        return get_fp32_state_dict_from_zero_checkpoint(str(ckpt_root), tag=tag)
    except pickle.UnpicklingError as exc:  # what the check could not see, the weights-only load refused
        found = re.search(r"GLOBAL (\S+) was not an allowed global", str(exc))
        raise refusal(tag, "a shard", found.group(1) if found else "unknown") from None
    except (FileNotFoundError, ValueError, KeyError, TypeError, IndexError, AttributeError, RuntimeError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise TrainerError(f"checkpoint {tag}: zero_to_fp32 cannot merge it: {first}") from None


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        export(args)
    except TrainerError as exc:
        print(f"export: error: {exc}", file=sys.stderr, flush=True)
        return 3 if isinstance(exc, UnsafeCheckpoint) else 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
