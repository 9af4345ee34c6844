"""An FSDP checkpoint (torch.distributed.checkpoint shards, one file set per rank) -> full weights.

Runs with no process group (the laptop's `gpuctl ckpt pull --hf`, or the node after the run): DCP
then reads every rank's shards itself and fills the plain model's full tensors in place. Only the
model's tensors are read; the optimizer state in the same files is left on disk. The checkpoint is
a node's: its ``.metadata`` is read without unpickling anything but DCP's own records
(safe_load.read_dcp_metadata), and every model entry must be a tensor (DCP would torch.load a
"bytes" entry with weights_only=False).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader

from trainer.config import TrainerError
from trainer.safe_load import UnsafeCheckpoint, printable, read_dcp_metadata

DCP_METADATA = ".metadata"
MODEL_PREFIX = "model."  # trainer.fsdp_engine saves {"model": ..., "optim": ...}


def is_dcp_checkpoint(tag_dir: Path) -> bool:
    return (tag_dir / DCP_METADATA).is_file()


class CheckedReader(FileSystemReader):
    """DCP's file reader, its metadata read by safe_load instead of pickle.load."""

    def __init__(self, tag_dir: Path, tag: str):
        super().__init__(str(tag_dir))
        self.tag_dir, self.tag = tag_dir, tag

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import StorageMeta

        metadata = read_dcp_metadata(self.tag_dir, self.tag, self.tag_dir / DCP_METADATA)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # what FileSystemReader.read_metadata does
        return metadata


def load_dcp_weights(model: torch.nn.Module, tag_dir: Path, tag: str, model_name: str) -> None:
    """Load the checkpoint's model weights into `model` strictly: a missing or extra tensor is an error."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = CheckedReader(tag_dir, tag)
    entries = {k: v for k, v in reader.read_metadata().state_dict_metadata.items() if k.startswith(MODEL_PREFIX)}
    for key, entry in entries.items():
        if not isinstance(entry, TensorStorageMetadata):
            raise UnsafeCheckpoint(
                f"checkpoint {tag}: .metadata lists {printable(key)} as {type(entry).__name__}, not a tensor"
            )
    saved = {key.removeprefix(MODEL_PREFIX) for key in entries}
    wanted = model.state_dict()
    missing, extra = sorted(set(wanted) - saved), sorted(saved - set(wanted))
    if missing or extra:
        raise TrainerError(
            f"checkpoint {tag} does not fit model {model_name!r}: "
            f"missing {missing[:3]}{'...' if len(missing) > 3 else ''}, unexpected {extra[:3]}"
            f"{'...' if len(extra) > 3 else ''}"
        )
    state = {"model": wanted}
    try:  # no process group: this process reads every rank's file
        dcp.load(state, storage_reader=CheckedReader(tag_dir, tag))
    except (dcp.CheckpointException, RuntimeError, ValueError, AssertionError) as exc:
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        raise TrainerError(f"checkpoint {tag}: its FSDP shards do not load: {first}") from None
    model.load_state_dict(state["model"], strict=True)
