"""Room on the node's disk for the next checkpoint (pure decisions; no torch, no DeepSpeed).

A 7B ZeRO-2 save is ~97 GB per node. Tags wait on disk until this node's uploader has them in the store;
a slow upload must not let them pile up until the disk is full mid-save. Before each save, local rank 0
of every node decides (and all ranks then agree, since saving is collective):
- ROOM: enough free space, after deleting local tags that are safe to delete, oldest first: uploaded, or
  older than an uploaded one (a failed upload superseded by a newer tag), or fetched from the store. Tags
  beyond train.keep_local go first, as always; when space is short, safe tags within keep_local go too
  (the store has them).
- WAIT: not enough yet, but an upload is running; it will make a tag safe to delete.
- NO_ROOM: nothing left to delete or wait for: the save is skipped (the final one fails the run).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

MARGIN_MAX = 256 * 2**20  # free space left over after a save (logs, metrics): 5% of it, at most this


class Room(IntEnum):
    """Ordered: the worst verdict of any node decides for all."""

    ROOM = 0
    WAIT = 1
    NO_ROOM = 2


@dataclass(frozen=True)
class LocalTag:
    step: int
    name: str
    bytes: int


def safe_to_delete(tags: list[LocalTag], uploaded: set[str] | None, from_store: set[str]) -> list[LocalTag]:
    """Tags whose content the store has, oldest first. uploaded None: no store (nothing is safe)."""
    if uploaded is None:
        return []
    newest_up = max((t.step for t in tags if t.name in uploaded), default=-1)
    return sorted(
        (t for t in tags if t.name in uploaded or t.name in from_store or t.step < newest_up),
        key=lambda t: t.step,
    )


def plan_room(
    tags: list[LocalTag],
    uploaded: set[str] | None,
    from_store: set[str],
    pending: list[str],
    free: int,
    need: int,
    keep_local: int,
) -> tuple[Room, list[LocalTag]]:
    """(verdict, tags to delete now). Tags beyond keep_local that are safe always go; with no store, tags
    beyond keep_local go too (the run's own retention)."""
    need += min(MARGIN_MAX, need // 20)
    newest = {t.name for t in sorted(tags, key=lambda t: t.step)[-keep_local:]}
    safe = safe_to_delete(tags, uploaded, from_store)
    if uploaded is None:
        delete = [t for t in tags if t.name not in newest]
    else:
        delete = [t for t in safe if t.name not in newest]
    freed = free + sum(t.bytes for t in delete)
    for t in safe:  # space is short: the store has these, keep_local or not
        if freed >= need:
            break
        if t not in delete:
            delete.append(t)
            freed += t.bytes
    if freed >= need:
        return Room.ROOM, delete
    return (Room.WAIT if pending else Room.NO_ROOM), delete


def tag_bytes(path: Path) -> int:
    """Bytes under a tag folder; 0 for what is gone. The uploader's thread deletes a superseded tag while
    the ranks measure, so a folder or file may vanish mid-walk: what vanished holds nothing."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except FileNotFoundError:
                pass
    return total


def free_bytes(path: Path) -> int:
    path.mkdir(parents=True, exist_ok=True)
    return shutil.disk_usage(path).free


def expected_save_bytes(params: int, precision: str, world: int, local_world: int, node_rank: int) -> int:
    """One ZeRO-1/2 save on this node: the 16-bit (or fp32) module states on node 0, and per local rank
    its optimizer shard: fp32 master + Adam m + v = 12 B x its partition (padded to 2 x world elements)."""
    w = 4 if precision == "fp32" else 2
    align = 2 * world
    partition = -(-params // align) * align // world
    return (w * params if node_rank == 0 else 0) + local_world * 12 * partition
