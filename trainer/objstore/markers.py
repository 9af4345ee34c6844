"""Node markers (<tag>/_nodes/<node_rank>.json) and the run attempt that wrote them.

A run that recovers from a lost node starts again on the same store, and saves tags that its
earlier attempt may have half uploaded: a node's marker of that attempt can still sit in the
store while the node's new upload of the tag has not begun. Node 0 must not publish a
checkpoint from it (it names another attempt's files, and the attempts' bytes can differ), so
each marker carries the attempt that wrote it (``CheckpointStore.attempt``: one random id per
start of the trainer, the same on every rank), and publish waits for markers of its own
attempt only. A store without an attempt (a tool outside a run) takes any marker.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Protocol

from trainer.objstore.layout import NODES_DIR

if TYPE_CHECKING:
    from trainer.objstore.backends import FileBackend
    from trainer.objstore.s3 import S3Backend

POLL_FIRST_S, POLL_MAX_S = 0.2, 5.0


class MarkerStore(Protocol):
    """What reading markers needs of a CheckpointStore (store.py), named by shape so that store.py
    imports this module and not the other way round."""

    @property
    def attempt(self) -> str | None: ...

    @property
    def backend(self) -> FileBackend | S3Backend: ...

    def read_json(self, key: str) -> dict[str, Any] | None: ...


def marker_key(tag: str, node_rank: int) -> str:
    return f"{tag}/{NODES_DIR}/{node_rank}.json"


def is_current(store: MarkerStore, marker: dict[str, Any]) -> bool:
    """Whether a marker was written by this store's attempt (any marker, where it has none)."""
    return store.attempt is None or marker.get("attempt") == store.attempt


def wait_for_markers(
    store: MarkerStore, tag: str, num_nodes: int, deadline: float
) -> tuple[dict[int, dict[str, Any]], list[int]]:
    """Poll until every node's marker of ``tag`` from this attempt is in, or ``deadline``
    (time.monotonic()) passes: (the markers read, by node rank; the node ranks still missing).
    A marker is read again only when its listing changed (size, time or ETag)."""
    wanted = {marker_key(tag, r): r for r in range(num_nodes)}
    seen: dict[str, tuple[Any, ...]] = {}
    found: dict[int, dict[str, Any]] = {}
    delay = POLL_FIRST_S
    while True:
        listed = store.backend.list(f"{tag}/{NODES_DIR}/")
        for key, rank in wanted.items():
            st = listed.get(key)
            if st is None:
                found.pop(rank, None)
                continue
            if seen.get(key) == (st.size, st.mtime, st.etag):
                continue
            seen[key] = (st.size, st.mtime, st.etag)
            marker = store.read_json(key)
            if marker is not None and is_current(store, marker):
                found[rank] = marker
            else:
                found.pop(rank, None)
        missing = sorted(set(wanted.values()) - set(found))
        if not missing or time.monotonic() + delay > deadline:
            return found, missing
        time.sleep(delay)
        delay = min(delay * 1.5, POLL_MAX_S)
