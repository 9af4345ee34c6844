"""Reading checkpoint files a node wrote without running them (`gpuctl ckpt pull --hf`, trainer.export).

A torch checkpoint is a pickle, and unpickling runs whatever callable the pickle names: DeepSpeed's
zero_to_fp32 loads shards with ``torch.load(weights_only=False)``, and torch.distributed.checkpoint
reads its ``.metadata`` with a plain ``pickle.load``. Every rented node holds the bucket's write key,
so a shard is hostile input. Here:

- ``guard_torch_load``: torch's weights-only unpickler for every torch.load in this process, whatever
  the caller passes (TORCH_FORCE_WEIGHTS_ONLY_LOAD, read by torch at each load), with an allowlist of
  exactly the classes beyond torch's own that DeepSpeed 0.19's ZeRO checkpoints pickle. Found with
  torch.serialization.get_unsafe_globals_in_checkpoint on real saves: ZeRO-1/2/3, fp32/bf16/fp16,
  with and without CPU offload. Each is only constructed (an enum, a dataclass, two plain classes
  whose __init__ stores numbers); zero_to_fp32 calls none of their methods.
- ``check_torch_files``: before anything loads, every ``*.pt`` of the tag is disassembled (not run)
  and a global outside that set refuses the checkpoint in one line naming the file.
- ``read_dcp_metadata``: ``.metadata`` through an unpickler that resolves only DCP's metadata
  dataclasses and the torch types they hold; then every storage entry must name a file of the tag
  folder and a byte range inside it (the readers seek and read there).
"""

from __future__ import annotations

import io
import os
import pickle
import re
from pathlib import Path, PurePosixPath
from typing import Any

from trainer.config import TrainerError

FORCE_ENV, NO_FORCE_ENV = "TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"
DEEPSPEED_GLOBALS = (
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),  # fp32/bf16 runs
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),  # fp16 runs
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
    ("deepspeed.utils.tensor_fragment", "fragment_address"),  # ZeRO-1/2
)
DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # torch.layout pickles as _get_layout("torch.strided")
    "torch": {"Size"},  # and the dtypes (torch.float32 ...), checked by type below
}
PATH_MODULES = ("pathlib", "pathlib._local")  # StorageMeta.checkpoint_id: a PosixPath (3.13: pathlib._local)
MAX_METADATA = 64 << 20  # bytes; a 7B model saved by 3 ranks writes ~0.25 MB


class UnsafeCheckpoint(TrainerError):
    """The checkpoint holds something this process will not load (trainer.export exits 3)."""


def printable(text: str) -> str:
    """A name from a file, safe to print: as is when plain, else escaped (no terminal control bytes)."""
    return text if re.fullmatch(r"[\w.<>-]{1,200}", text, re.ASCII) else ascii(text[:200])


def refusal(tag: str, where: str, *global_names: str) -> UnsafeCheckpoint:
    """``where``: the file (printable already); the globals it names that are not allowed (first 3)."""
    names = ", ".join(printable(name) for name in global_names[:3]) + (", ..." if len(global_names) > 3 else "")
    return UnsafeCheckpoint(
        f"checkpoint {tag}: {where} holds a pickled object outside the allowlist (GLOBAL {names}); refusing to load it"
    )


def guard_torch_load() -> None:
    """Every torch.load in this process from now on: weights only, DeepSpeed's classes allowed."""
    import importlib

    import torch

    os.environ.pop(NO_FORCE_ENV, None)  # both set is an error in torch; ours wins
    os.environ[FORCE_ENV] = "1"
    allowed = [getattr(importlib.import_module(module), name) for module, name in DEEPSPEED_GLOBALS]
    torch.serialization.add_safe_globals(allowed)


def check_torch_files(tag_dir: Path, tag: str) -> None:
    """Every *.pt of the tag (what zero_to_fp32 reads: *_model_states.pt, *_optim_states.pt) holds only
    globals the weights-only loader allows, DeepSpeed's included (guard_torch_load first)."""
    import torch

    for path in sorted(tag_dir.glob("*.pt")):
        try:
            unsafe = sorted(torch.serialization.get_unsafe_globals_in_checkpoint(path))
        except (ValueError, RuntimeError, EOFError, pickle.UnpicklingError, OSError) as exc:
            raise UnsafeCheckpoint(
                f"checkpoint {tag}: {printable(path.name)} is not a torch.save archive the weights-only "
                f"loader reads ({type(exc).__name__}); refusing to load it"
            ) from None
        if unsafe:
            raise refusal(tag, printable(path.name), *unsafe)


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, tag: str):
        super().__init__(io.BytesIO(data))
        self.tag = tag

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if module in PATH_MODULES and name in ("PosixPath", "PurePosixPath"):
            return PurePosixPath  # a name only: never opened
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if name in DCP_CLASSES.get(module, ()):
            return super().find_class(module, name)
        raise refusal(self.tag, ".metadata", f"{module}.{name}")


def read_dcp_metadata(tag_dir: Path, tag: str, metadata_file: Path) -> Any:
    """DCP's Metadata from ``metadata_file``, read without running anything it names and checked
    (UnsafeCheckpoint otherwise): storage lies in files of ``tag_dir``, inside their sizes."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata

    with open(metadata_file, "rb") as fh:
        data = fh.read(MAX_METADATA + 1)
    if len(data) > MAX_METADATA:
        raise UnsafeCheckpoint(f"checkpoint {tag}: .metadata is over {MAX_METADATA >> 20} MiB; refusing to load it")
    try:
        metadata = _MetadataUnpickler(data, tag).load()
    except UnsafeCheckpoint:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, KeyError, AttributeError, IndexError) as exc:
        raise UnsafeCheckpoint(f"checkpoint {tag}: .metadata is not DCP metadata ({type(exc).__name__})") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise UnsafeCheckpoint(
            f"checkpoint {tag}: .metadata is not DCP metadata (it holds a {type(metadata).__name__})"
        )
    if not isinstance(metadata.storage_data, dict):
        raise UnsafeCheckpoint(f"checkpoint {tag}: .metadata has no storage index")
    for info in metadata.storage_data.values():
        if not isinstance(info, _StorageInfo):
            raise UnsafeCheckpoint(f"checkpoint {tag}: .metadata has a storage entry of type {type(info).__name__}")
        _check_storage(tag_dir, tag, info)
    return metadata


def _check_storage(tag_dir: Path, tag: str, info: Any) -> None:
    """A byte range the reader will open: a file of the tag folder (no path), inside its size, untransformed."""
    name, offset, length = info.relative_path, info.offset, info.length
    plain = isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\0" not in name
    path = tag_dir / name if plain else None
    if path is None or not path.is_file() or path.is_symlink():
        raise UnsafeCheckpoint(f"checkpoint {tag}: .metadata points at {printable(str(name))}, not a file of the tag")
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in (offset, length)):
        raise UnsafeCheckpoint(f"checkpoint {tag}: .metadata has a bad byte range in {printable(name)}")
    if offset + length > path.stat().st_size:
        raise UnsafeCheckpoint(f"checkpoint {tag}: .metadata reads past the end of {printable(name)}")
    if info.transform_descriptors:  # e.g. zstd: trainer.fsdp_engine saves none
        raise UnsafeCheckpoint(f"checkpoint {tag}: .metadata asks for stream transforms; refusing to load it")
