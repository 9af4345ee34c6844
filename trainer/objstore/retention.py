"""Which checkpoints a store keeps, and which one a node gets back: pruning beyond ``keep``
(after a publish) and downloading with fallback to an older complete checkpoint. The half of
CheckpointStore (store.py) that reads and deletes; store.py uploads and publishes.
"""

from __future__ import annotations

import builtins
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from trainer.objstore.atomic import atomic_write
from trainer.objstore.backends import FileBackend, ProgressFn, StorageNotFound, UnsafeManifest, VerificationError
from trainer.objstore.fetch import fetch_tag
from trainer.objstore.layout import LATEST, MANIFEST, CheckpointInfo, check_tag, step_from_tag

if TYPE_CHECKING:
    from trainer.objstore.s3 import S3Backend

_log = logging.getLogger("gpuctl.objstore")


class KeptStore(Protocol):
    """What pruning and downloading need of a CheckpointStore (store.py), named by shape so that
    store.py imports this module and not the other way round."""

    @property
    def backend(self) -> FileBackend | S3Backend: ...

    @property
    def keep(self) -> int | None: ...

    @property
    def url(self) -> str: ...

    @property
    def log(self) -> Callable[[str], None]: ...

    def list(self) -> builtins.list[CheckpointInfo]: ...

    def latest(self) -> CheckpointInfo | None: ...


def prune(store: KeptStore, infos: list[CheckpointInfo] | None = None) -> None:
    """Keep the newest ``keep`` complete checkpoints; drop older complete ones and
    incomplete ones older than the oldest kept. Manifest first, so a half-deleted
    checkpoint is never taken for complete."""
    if not store.keep:
        return
    infos = infos if infos is not None else store.list()
    complete = [i for i in infos if i.complete]
    if len(complete) <= store.keep:
        return
    kept = complete[: store.keep]
    oldest_kept = kept[-1].step
    raw = store.backend.read_bytes(LATEST)
    latest_tag = raw.decode("utf-8", "replace").strip() if raw else ""
    for info in store.list():
        if info.tag in {k.tag for k in kept} or info.tag == latest_tag:
            continue
        if info.complete or (0 <= info.step < oldest_kept):
            store.backend.delete([f"{info.tag}/{MANIFEST}"])
            store.backend.delete_prefix(info.tag)
            _log.info("pruned checkpoint %s from %s", info.tag, store.url)


def download(store: KeptStore, tag: str | None, dest: Path, progress: ProgressFn | None = None) -> CheckpointInfo:
    """Download ``tag`` (None: the latest complete) into ``dest/<tag>`` and write
    ``dest/latest``. Falls back to older complete checkpoints if it fails verification."""
    dest = Path(dest)
    infos = store.list()
    if tag is not None:
        check_tag(tag)
        refused = next((i for i in infos if i.tag == tag and i.problem), None)
        if refused is not None and refused.problem:  # asked for by name: say why, no fallback
            raise UnsafeManifest(refused.problem)
    complete = [i for i in infos if i.complete]
    if tag is None:
        first = store.latest()
        if first is None:
            raise StorageNotFound(f"no complete checkpoint in {store.url}")
    else:
        first = next((i for i in complete if i.tag == check_tag(tag)), None)
        if first is None:
            older = [i for i in complete if i.step < step_from_tag(tag)]
            if not older:
                raise StorageNotFound(
                    f"checkpoint {tag} is not complete in {store.url} and there is no older complete one"
                )
            store.log(f"checkpoint {tag} is not complete in {store.url}; falling back to {older[0].tag}")
            first = older[0]
    candidates = [first] + [i for i in complete if i.step < first.step]
    for n, info in enumerate(candidates):
        try:
            fetch_tag(store.backend, info, dest, progress)
        except (VerificationError, StorageNotFound) as exc:
            nxt = candidates[n + 1].tag if n + 1 < len(candidates) else None
            if nxt is None:
                raise VerificationError(
                    f"checkpoint {info.tag} failed verification ({exc}) "
                    f"and no older complete checkpoint is left in {store.url}"
                ) from exc
            store.log(
                f"checkpoint {info.tag} failed verification ({exc}); falling back to previous complete checkpoint {nxt}"
            )
            continue
        atomic_write(dest / LATEST, info.tag)
        return info
    raise AssertionError("unreachable")  # the loop returns or raises
