"""Before a run ships with --resume: the checkpoint it names is in the store, complete, and saved
by as many ranks as the cluster has (flows/job.py's start_run asks)."""

from __future__ import annotations

import re
from collections.abc import Callable

from provision.core import state
from provision.core.config import GpuctlConfig
from provision.core.errors import ConfigError, NotFoundError


def check_resume(
    cfg: GpuctlConfig, cluster: state.ClusterRecord, resume: str | None, say: Callable[[str], None]
) -> None:
    """Before anything ships: the checkpoint to resume from is in the store and fits the cluster.

    The node downloads and verifies it (falling back to an older complete one on a bad shard);
    this only reads manifests. A store the laptop cannot reach is left to the node.
    """
    if resume is None or resume.startswith("/"):
        return
    from trainer.objstore.backends import StorageError, StorageUnavailable
    from trainer.objstore.store import CheckpointStore

    store = CheckpointStore.from_config(cfg.storage_settings(), log=say)
    try:
        if resume == "latest":
            info = store.latest()
        else:
            info = store.info(resume) or next(
                (i for i in store.list() if i.complete and 0 <= i.step < _tag_step(resume)), None
            )
            if info is not None and info.tag != resume:
                say(f"checkpoint {resume} is not complete in {store.url}; the node will fall back to {info.tag}")
    except ValueError as exc:  # not a valid tag name
        raise ConfigError(f"--resume-from {resume}: {exc}", "`gpuctl ckpt ls` lists the tags") from None
    except StorageUnavailable as exc:
        say(f"warning: cannot check the checkpoint from here ({exc}); the node will")
        return
    except StorageError as exc:
        raise ConfigError(f"cannot read checkpoints in {store.url}: {exc}", "fix storage in gpuctl.yaml") from None
    if info is None:
        what = "complete checkpoint" if resume == "latest" else f"complete checkpoint {resume} (or older)"
        raise NotFoundError(
            f"no {what} in {store.url} to resume from",
            "`gpuctl ckpt ls` lists what is there; drop --resume to start fresh",
        )
    if info.world_size != cluster.world_size:
        raise ConfigError(
            f"checkpoint {info.tag} was saved by {info.world_size} ranks but cluster {cluster.name} "
            f"has {cluster.world_size}; resume needs the same world size",
            f"run on {info.world_size} ranks, or `gpuctl ckpt pull {info.tag} --hf DIR` and "
            "start a new run with train.model: DIR",
        )
    say(f"resuming from {info.tag} (step {info.step}) in {store.url}")


def _tag_step(tag: str) -> int:
    digits = re.search(r"(\d+)$", tag)
    return int(digits.group(1)) if digits else -1
