"""Tokenizers that work offline.

`tiny` uses a byte-level tokenizer built right here with the `tokenizers` library: one token
per byte (GPT-2's byte-to-unicode alphabet, no merges) plus <s>, </s>, <pad>. Nothing is
downloaded or trained, so every rank and every machine builds the identical tokenizer, and
any text round-trips exactly. It is wrapped as a transformers fast tokenizer, so
`save_pretrained` / `AutoTokenizer.from_pretrained` work on it (ckpt pull --hf saves it
next to the model). Other models use their own tokenizer through AutoTokenizer.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from trainer.config import TrainConfig, TrainerError

BOS, EOS, PAD = "<s>", "</s>", "<pad>"


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable unicode characters."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return chars


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """Token id = byte value (0..255); then <s>=256, </s>=257, <pad>=258."""
    vocab = {char: byte for byte, char in bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([BOS, EOS, PAD])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, model_max_length=1 << 30
    )


def load_tokenizer(train: TrainConfig):
    """The tokenizer for this run: built-in bytes for `tiny`, else from train.tokenizer or the model."""
    source = train.tokenizer or (None if train.model == "tiny" else train.model)
    if source is None or source == "bytes":
        return byte_tokenizer()
    try:
        tok = AutoTokenizer.from_pretrained(source)
    except OSError as exc:
        raise TrainerError(f"cannot load tokenizer {source!r}: {exc}".splitlines()[0]) from None
    if tok.eos_token_id is None:
        raise TrainerError(f"tokenizer {source!r} has no eos token; packing needs one between documents")
    return tok
