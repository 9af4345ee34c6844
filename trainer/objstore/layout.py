"""How checkpoints sit in a store, and the names and records that describe them.

Layout under the store root (``s3://bucket/prefix`` or ``file:///abs/dir``)::

    <root>/<tag>/<relative files>            DeepSpeed's save dir for that tag, e.g.
                                             step20/mp_rank_00_model_states.pt
    <root>/<tag>/_nodes/<node_rank>.json     written by each node after ALL of its files
                                             of <tag> are uploaded:
                                             {"format", "tag", "node_rank", "step", "time",
                                              "files": {relpath: {"size", "sha256"}}}
    <root>/<tag>/manifest.json               written by node 0 once every node's marker
                                             is in: {"format", "tag", "step", "world_size",
                                             "num_nodes", "time",
                                             "files": {relpath: {"size", "sha256", "node"}}}
    <root>/latest                            the newest complete tag, written LAST

A checkpoint is complete iff its manifest.json exists; ``latest`` only ever names a
complete checkpoint (it is written after the manifest, and a complete checkpoint is
first un-published, manifest deleted, before it is changed). Every S3 object also
carries its sha256 in user metadata (``x-amz-meta-sha256``).

Tags and the paths a manifest lists come back from a store that a rented node could write:
they are checked here (a plain name; a relative path without "..") before any use.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.objstore.backends import InvalidTag, VerificationError

FORMAT = 1
LATEST = "latest"
MANIFEST = "manifest.json"
NODES_DIR = "_nodes"
TAG_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
STEP_RE = re.compile(r"(\d+)$")


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative to the tag dir, "/" separated
    size: int
    sha256: str  # "" where not known (incomplete checkpoints listed without markers)


@dataclass
class CheckpointInfo:
    tag: str
    step: int  # -1 if unknown (an incomplete checkpoint whose tag has no trailing number)
    world_size: int  # 0 if unknown (incomplete)
    num_nodes: int  # complete: from the manifest; incomplete: nodes whose marker is in
    complete: bool
    size: int  # bytes: manifest total, or what is stored so far
    time: float  # epoch: manifest time, or the newest object's mtime
    files: list[FileEntry] = field(default_factory=list)


def check_tag(tag: str) -> str:
    if not TAG_RE.match(tag) or tag in (LATEST, NODES_DIR):
        raise InvalidTag(f"invalid checkpoint tag {tag!r}: use letters, digits, '.', '_', '-'")
    return tag


def safe_relpath(rel: str) -> str:
    """Reject manifest paths that would escape the destination directory."""
    parts = rel.split("/")
    if not rel or rel.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise VerificationError(f"unsafe path {rel!r} in manifest")
    return rel


def step_from_tag(tag: str) -> int:
    m = STEP_RE.search(tag)
    return int(m.group(1)) if m else -1


def local_files(tag_dir: Path) -> dict[str, Path]:
    if not tag_dir.is_dir():
        raise FileNotFoundError(f"checkpoint directory {tag_dir} does not exist")
    out = {}
    for p in sorted(tag_dir.rglob("*")):
        if p.is_file():
            rel = p.relative_to(tag_dir).as_posix()
            if rel == MANIFEST or rel.startswith(NODES_DIR + "/"):
                raise ValueError(f"{p}: {rel!r} is reserved for checkpoint metadata")
            out[rel] = p
    return out


def dumps(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, indent=1, sort_keys=True).encode()
