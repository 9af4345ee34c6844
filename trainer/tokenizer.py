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
# Text every causal-LM tokenizer must give back: words, single and double spaces, a newline, digits,
# punctuation, accents. transformers 5.0-5.21 load DeepSeek's ByteLevel tokenizer.json (labelled
# LlamaTokenizerFast) as a SentencePiece-style LlamaTokenizer that drops every space (transformers #45488,
# #48206; 5.22+ and 4.x round-trip it): training on that silently trains on the wrong text.
ROUND_TRIP_PROBE = "The quick brown fox,  twice spaced,\njumps over 1234 lazy dogs (x+y) naïve café."


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
    if not round_trips(tok):
        tok = _tokenizer_json_as_is(source, tok)
    if tok.eos_token_id is None:
        raise TrainerError(f"tokenizer {source!r} has no eos token; packing needs one between documents")
    return tok


def round_trips(tok) -> bool:
    """encode -> decode gives the probe text back (leading/trailing whitespace aside)."""
    ids = tok.encode(ROUND_TRIP_PROBE, add_special_tokens=False)
    back = tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    return back.strip() == ROUND_TRIP_PROBE.strip()


def _tokenizer_json_as_is(source: str, broken):
    """AutoTokenizer mangled the text: load tokenizer.json as written (PreTrainedTokenizerFast keeps its
    pre-tokenizer and decoder), or stop with one line naming the problem."""
    import transformers

    try:
        tok = PreTrainedTokenizerFast.from_pretrained(source)
    except (OSError, ValueError):
        tok = None
    if tok is not None and round_trips(tok):
        print(
            f"trainer: warning: transformers {transformers.__version__} loads {source!r} as "
            f"{type(broken).__name__}, which does not give text back; using its tokenizer.json as is",
            flush=True,
        )
        return tok
    sample = broken.decode(broken.encode(ROUND_TRIP_PROBE, add_special_tokens=False), skip_special_tokens=True)
    raise TrainerError(
        f"tokenizer {source!r} does not round-trip text under transformers {transformers.__version__} "
        f"({ROUND_TRIP_PROBE[:24]!r} comes back as {sample[:24]!r}); use transformers 5.22 or later (the image pins "
        "5.24.0) or 4.x"
    )
