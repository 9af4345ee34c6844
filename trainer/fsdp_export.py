"""An FSDP checkpoint (torch.distributed.checkpoint shards, one file set per rank) -> full weights.

Runs with no process group (the laptop's `gpuctl ckpt pull --hf`, or the node after the run): DCP
then reads every rank's shards itself and fills the plain model's full tensors in place. Only the
model's tensors are read; the optimizer state in the same files is left on disk.
"""

from __future__ import annotations

from pathlib import Path

import torch

from trainer.config import TrainerError

DCP_METADATA = ".metadata"
MODEL_PREFIX = "model."  # trainer.fsdp_engine saves {"model": ..., "optim": ...}


def is_dcp_checkpoint(tag_dir: Path) -> bool:
    return (tag_dir / DCP_METADATA).is_file()


def load_dcp_weights(model: torch.nn.Module, tag_dir: Path, tag: str, model_name: str) -> None:
    """Load the checkpoint's model weights into `model` strictly: a missing or extra tensor is an error."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    saved = {
        key.removeprefix(MODEL_PREFIX)
        for key in FileSystemReader(str(tag_dir)).read_metadata().state_dict_metadata
        if key.startswith(MODEL_PREFIX)
    }
    wanted = model.state_dict()
    missing, extra = sorted(set(wanted) - saved), sorted(saved - set(wanted))
    if missing or extra:
        raise TrainerError(
            f"checkpoint {tag} does not fit model {model_name!r}: "
            f"missing {missing[:3]}{'...' if len(missing) > 3 else ''}, unexpected {extra[:3]}"
            f"{'...' if len(extra) > 3 else ''}"
        )
    state = {"model": wanted}
    dcp.load(state, checkpoint_id=str(tag_dir))  # no process group: this process reads every rank's file
    model.load_state_dict(state["model"], strict=True)
