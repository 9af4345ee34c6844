"""Data: read documents, tokenize once into a token file, pack, and hand out batches.

- Sources: 'sample' (trainer/data/sample.txt), .txt (one document per non-empty line),
  .jsonl (field "text"), .parquet (column "text"; needs pyarrow); a path in the run dir or
  s3://bucket/key (downloaded first by local rank 0 of each node: trainer/remote_data.py).
- Local rank 0 of each node tokenizes the documents ONCE (each + eos) into a flat token file
  under <run dir>/cache/; the other ranks wait at a barrier, then every rank memory-maps it.
- Packing: the token stream is cut into blocks of seq_len + 1 (input = block[:-1],
  target = block[1:]); the tail that does not fill a block is dropped.
- Order: epoch e visits the blocks in the permutation seeded by (seed, e). Global step s
  consumes the next train_batch_size positions of that endless sequence, and within it rank r
  at micro-step m takes slice (m * world + r) * micro_batch. So the global batch of a step is
  the same for any world size x grad_accum split (3 ranks x 4 == 1 rank x 12).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from trainer import remote_data
from trainer.config import TrainerError

SAMPLE = Path(__file__).with_name("data") / "sample.txt"
ENCODE_CHUNK = 1000  # documents per tokenizer call


def resolve_data(data: str, run_dir: Path) -> Path:
    """The local file for train.data; for s3:// the cached copy's path (downloaded or not)."""
    if data == "sample":
        return SAMPLE
    if remote_data.is_remote(data):
        return remote_data.local_copy(data, run_dir / "cache")
    path = (run_dir / data).resolve()
    if not path.is_file():
        raise TrainerError(f"train.data {data!r}: no such file ({path})")
    if path.suffix not in (".txt", ".jsonl", ".parquet"):
        raise TrainerError(f"train.data {data!r}: expected a .txt, .jsonl or .parquet file")
    return path


def prepare_token_file(data: str, run_dir: Path, storage: dict | None, tokenizer, log: Callable[[str], None]) -> Path:
    """Local rank 0's part: fetch s3:// data into the cache, then tokenize once; returns the token file."""
    source = (
        remote_data.download(data, storage, run_dir / "cache", log)
        if remote_data.is_remote(data)
        else resolve_data(data, run_dir)
    )
    token_file = cache_path(source, tokenizer, run_dir / "cache")
    if not token_file.exists():
        tokenize_to_file(source, tokenizer, token_file, log)
    return token_file


def iter_documents(path: Path) -> Iterator[str]:
    if path.suffix == ".parquet":
        yield from _parquet_documents(path)
        return
    with path.open(encoding="utf-8") as handle:
        for lineno, line in enumerate(handle, 1):
            if path.suffix == ".jsonl":
                yield _jsonl_text(line, path, lineno)
            elif line.strip():
                yield line.rstrip("\n")


def _jsonl_text(line: str, path: Path, lineno: int) -> str:
    try:
        text = json.loads(line).get("text") if line.strip() else ""
    except (json.JSONDecodeError, AttributeError):
        raise TrainerError(f'{path.name}:{lineno}: not a JSON object with a "text" field') from None
    if not isinstance(text, str):
        raise TrainerError(f'{path.name}:{lineno}: "text" must be a string')
    return text


def _parquet_documents(path: Path) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise TrainerError(f"{path.name}: reading .parquet needs pyarrow (pip install pyarrow)") from None
    parquet = pq.ParquetFile(path)
    if "text" not in parquet.schema_arrow.names:
        raise TrainerError(f'{path.name}: no "text" column (columns: {parquet.schema_arrow.names})')
    for batch in parquet.iter_batches(columns=["text"], batch_size=ENCODE_CHUNK):
        yield from (t for t in batch.column(0).to_pylist() if t)


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.uint32)


def cache_path(path: Path, tokenizer, cache_dir: Path) -> Path:
    """A name that changes when the data file or the tokenizer changes."""
    stat = path.stat()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    fingerprint = backend.to_str() if backend is not None else f"{tokenizer.name_or_path}|{len(tokenizer)}"
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{fingerprint}".encode()
    return cache_dir / f"tokens-{path.stem}-{hashlib.sha256(key).hexdigest()[:16]}.bin"


def tokenize_to_file(path: Path, tokenizer, out: Path, log: Callable[[str], None]) -> None:
    """Tokenize every document (+ eos) into a flat binary file; atomic (tmp + rename)."""
    dtype, eos = token_dtype(len(tokenizer)), tokenizer.eos_token_id
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    total_bytes, done_docs, done_tokens, started = path.stat().st_size, 0, 0, time.monotonic()
    next_report = started + 10.0
    log(f"data: tokenizing {path.name} ({total_bytes / 1e6:.1f} MB) -> {out}")
    with tmp.open("wb") as handle:
        for chunk in _chunks(iter_documents(path), ENCODE_CHUNK):
            ids = tokenizer(chunk, add_special_tokens=False)["input_ids"]
            flat = np.fromiter((t for doc in ids for t in (*doc, eos)), dtype=np.int64)
            flat.astype(dtype).tofile(handle)
            done_docs, done_tokens = done_docs + len(chunk), done_tokens + flat.size
            if time.monotonic() >= next_report:
                log(f"data: {done_docs} documents, {done_tokens / 1e6:.1f}M tokens ({time.monotonic() - started:.0f}s)")
                next_report = time.monotonic() + 10.0
    os.replace(tmp, out)
    log(f"data: {done_docs} documents, {done_tokens} tokens in {time.monotonic() - started:.1f}s")


def _chunks(items: Iterator[str], size: int) -> Iterator[list[str]]:
    chunk: list[str] = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


class PackedTokens:
    """Blocks of seq_len + 1 tokens over a memory-mapped token file."""

    def __init__(self, token_file: Path, vocab_size: int, seq_len: int):
        self.tokens = np.memmap(token_file, dtype=token_dtype(vocab_size), mode="r")
        self.block = seq_len + 1
        self.num_samples = len(self.tokens) // self.block
        if self.num_samples == 0:
            raise TrainerError(
                f"data has {len(self.tokens)} tokens, fewer than one sample of "
                f"seq_len + 1 = {self.block}; use more data or a smaller seq_len"
            )

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        rows = np.stack([self.tokens[i * self.block : (i + 1) * self.block] for i in indices]).astype(np.int64)
        blocks = torch.from_numpy(rows)
        return blocks[:, :-1], blocks[:, 1:]


class Sampler:
    """The endless, seeded order of sample indices, sliced per global step / rank / micro-step."""

    def __init__(self, num_samples: int, seed: int):
        self.num_samples, self.seed = num_samples, seed
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 2:
                self._perms.pop(min(self._perms))
            self._perms[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
        return self._perms[epoch]

    def global_batch(self, position: int, batch_size: int) -> np.ndarray:
        """Sample indices at positions [position, position + batch_size) of the endless order."""
        positions = np.arange(position, position + batch_size)
        epochs, offsets = np.divmod(positions, self.num_samples)
        return np.array([self._perm(int(e))[o] for e, o in zip(epochs, offsets, strict=True)], dtype=np.int64)


def micro_slice(global_batch: np.ndarray, rank: int, micro: int, world: int, micro_batch: int) -> np.ndarray:
    """The part of a step's global batch that `rank` trains on at micro-step `micro`."""
    start = (micro * world + rank) * micro_batch
    return global_batch[start : start + micro_batch]
