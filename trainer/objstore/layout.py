"""How checkpoints sit in a store, and the names and records that describe them.

Layout under the store root (``s3://bucket/prefix`` or ``file:///abs/dir``)::

    <root>/<tag>/<relative files>            DeepSpeed's save dir for that tag, e.g.
                                             step20/mp_rank_00_model_states.pt
    <root>/<tag>/_nodes/<node_rank>.json     written by each node after ALL of its files
                                             of <tag> are uploaded:
                                             {"format", "tag", "node_rank", "step", "time",
                                              "attempt" (the run start that wrote it, markers.py),
                                              "files": {relpath: {"size", "sha256"[, "s3_sha256"
                                              (multipart composite), "md5" (its ETag)]}}}
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
they are checked here before any use (``manifest_info``, ``marker_files``): a manifest's tag
must be the folder it sits in and match TAG_RE, every path is relative without "." or "..",
sizes are non-negative integers and digests 64 hex digits. Anything else is UnsafeManifest,
raised before a byte is written (the destination check in store.download is the second wall).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.objstore.backends import InvalidTag, UnsafeManifest

FORMAT = 1
LATEST = "latest"
MANIFEST = "manifest.json"
NODES_DIR = "_nodes"
TAG_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
STEP_RE = re.compile(r"(\d+)$")
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
MD5_RE = re.compile(r"^[0-9a-f]{32}$")
MAX_PATH = 1024  # bytes of one relative path (Linux: 4096 for a whole path)
NAME_MAX = 255  # bytes of one file or folder name (Linux, macOS)


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
    problem: str | None = None  # why its manifest was refused (then listed as incomplete, never pulled)


def check_tag(tag: str) -> str:
    if not TAG_RE.match(tag) or tag in (LATEST, NODES_DIR):
        raise InvalidTag(f"invalid checkpoint tag {tag!r}: use letters, digits, '.', '_', '-'")
    return tag


def safe_relpath(rel: object) -> str:
    """Reject manifest paths that would escape the destination directory."""
    if not isinstance(rel, str):
        raise UnsafeManifest(f"a path in the manifest is {type(rel).__name__}, not text")
    try:  # JSON can hold a lone surrogate ("\\ud800"), which no file system takes
        encoded = rel.encode("utf-8")
    except UnicodeEncodeError:
        raise UnsafeManifest(f"path {rel[:200]!r} in manifest is not valid Unicode (a lone surrogate)") from None
    parts = rel.split("/")
    if (
        not rel
        or len(encoded) > MAX_PATH
        or any(p in ("", ".", "..") or len(p.encode()) > NAME_MAX for p in parts)
        or any(ord(c) < 32 or c == "\x7f" for c in rel)
    ):
        raise UnsafeManifest(f"unsafe path {rel[:200]!r} in manifest")
    if rel == MANIFEST or parts[0] == NODES_DIR:
        raise UnsafeManifest(f"manifest lists {rel!r}, a name reserved for checkpoint metadata")
    return rel


def _count(value: object, what: str, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise UnsafeManifest(f"{what} is {str(value)[:40]!r}, not an integer >= {low}")
    return value


def _file_entry(rel: object, rec: object) -> FileEntry:
    path = safe_relpath(rel)
    if not isinstance(rec, dict):
        raise UnsafeManifest(f"the record of {path!r} is not an object")
    sha = rec.get("sha256")
    if not isinstance(sha, str) or not SHA256_RE.match(sha):
        raise UnsafeManifest(f"the sha256 of {path!r} is not 64 hex digits")
    return FileEntry(path, _count(rec.get("size"), f"the size of {path!r}"), sha)


def manifest_info(m: object, tag: str, where: str) -> CheckpointInfo:
    """A complete checkpoint's record from the manifest found in folder ``tag``, every field checked.

    ``where`` names the object in messages (the store url and key)."""
    try:
        if not isinstance(m, dict):
            raise UnsafeManifest("it is not a JSON object")
        if m.get("tag") != tag:
            raise UnsafeManifest(f"its tag {str(m.get('tag'))[:200]!r} is not the folder it sits in ({tag!r})")
        check_tag(tag)
        files = m.get("files")
        if not isinstance(files, dict):
            raise UnsafeManifest("its files are not an object of path -> {size, sha256}")
        entries = [_file_entry(rel, rec) for rel, rec in sorted(files.items())]
        when = m.get("time")
        if isinstance(when, bool) or not isinstance(when, (int, float)) or not math.isfinite(when):
            raise UnsafeManifest(f"time is {str(when)[:40]!r}, not a number")
        return CheckpointInfo(
            tag=tag,
            step=_count(m.get("step"), "step"),
            world_size=_count(m.get("world_size"), "world_size", 1),
            num_nodes=_count(m.get("num_nodes"), "num_nodes", 1),
            complete=True,
            size=sum(f.size for f in entries),
            time=float(when),
            files=entries,
        )
    except (UnsafeManifest, InvalidTag) as exc:
        raise UnsafeManifest(f"{where}: {exc}") from None


def file_record(size: int, sha256: str, composite: str | None, md5: str | None) -> dict[str, Any]:
    """A node marker's entry for one file (the layout above)."""
    rec: dict[str, Any] = {"size": size, "sha256": sha256}
    if composite is not None:
        rec["s3_sha256"] = composite
    if md5 is not None:
        rec["md5"] = md5
    return rec


def marker_files(marker: object, where: str) -> dict[str, dict[str, Any]]:
    """The files a node marker lists ({path: {"size", "sha256"[, "s3_sha256", "md5"]}}), every entry checked."""
    try:
        files = marker.get("files") if isinstance(marker, dict) else None
        if not isinstance(files, dict):
            raise UnsafeManifest("its files are not an object of path -> {size, sha256}")
        out: dict[str, dict[str, Any]] = {}
        for rel, rec in files.items():
            entry = _file_entry(rel, rec)
            out[entry.path] = {"size": entry.size, "sha256": entry.sha256}
            composite = rec.get("s3_sha256")
            if composite is not None:
                if not isinstance(composite, str) or len(composite) > 100:
                    raise UnsafeManifest(f"the s3_sha256 of {entry.path!r} is not a checksum")
                out[entry.path]["s3_sha256"] = composite
            md5 = rec.get("md5")
            if md5 is not None:
                if not isinstance(md5, str) or not MD5_RE.match(md5):
                    raise UnsafeManifest(f"the md5 of {entry.path!r} is not 32 hex digits")
                out[entry.path]["md5"] = md5
        return out
    except UnsafeManifest as exc:
        raise UnsafeManifest(f"{where}: {exc}") from None


def inside(root: Path, paths: list[Path]) -> None:
    """Every path, resolved (symlinks followed), stays under root: else UnsafeManifest, nothing written."""
    base = Path(root).resolve()
    for path in paths:
        if not path.resolve().is_relative_to(base):
            raise UnsafeManifest(f"checkpoint file {path} would land outside {root}; refusing to download")


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
