"""Downloading one complete checkpoint into ``dest/<tag>``, every file verified.

The manifest was checked when it was read (layout.manifest_info); here every destination is
checked to stay inside ``dest`` before a byte is written, sizes are compared with the store's
listing, and each file lands under a temporary name and is moved into place only once its
size and sha256 match (the backend hashes the bytes as it writes them: no second read). Files already there with the right digest are kept (a resumed pull).
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from trainer.objstore.backends import (
    DownloadItem,
    FileBackend,
    Progress,
    ProgressFn,
    StorageNotFound,
    VerificationError,
    sha256_file,
)
from trainer.objstore.layout import CheckpointInfo, inside

if TYPE_CHECKING:
    from trainer.objstore.s3 import S3Backend


def temp_name(local: Path, rel: str) -> Path:
    """Where a file lands before it is checked: hidden, this process's, short (a 255-byte name plus
    a prefix would pass NAME_MAX). The pid: two nodes on a shared file system (NFS) may fetch into
    one folder at once."""
    return local.with_name(f".tmp-{os.getpid()}-{hashlib.sha256(rel.encode()).hexdigest()[:24]}")


def fetch_tag(backend: FileBackend | S3Backend, info: CheckpointInfo, dest: Path, progress: ProgressFn | None) -> None:
    """Download checkpoint ``info`` into dest/<tag>; VerificationError / StorageNotFound when a
    file is missing or wrong: the folder this call created (dest, or dest/<tag>) is removed again.
    Any other failure removes it only while empty: files already checked stay for the next pull."""
    tag_dir = dest / info.tag
    inside(dest, [tag_dir / f.path for f in info.files])  # before anything is written
    created = None if tag_dir.exists() else tag_dir if dest.exists() else dest
    try:
        _fetch(backend, info, tag_dir, progress)
    except (VerificationError, StorageNotFound):
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        raise
    except BaseException:  # e.g. Ctrl-C, a full disk
        if created is not None and not any(p.is_file() for p in created.rglob("*")):
            shutil.rmtree(created, ignore_errors=True)
        raise


def _fetch(backend: FileBackend | S3Backend, info: CheckpointInfo, tag_dir: Path, progress: ProgressFn | None) -> None:
    remote = backend.list(f"{info.tag}/")
    for f in info.files:
        st = remote.get(f"{info.tag}/{f.path}")
        if st is None:
            raise StorageNotFound(f"shard {f.path} is missing")
        if st.size != f.size:
            raise VerificationError(f"shard {f.path} is {st.size} bytes, manifest says {f.size}")
    todo = []
    for f in info.files:
        local = tag_dir / f.path
        if local.is_file() and local.stat().st_size == f.size and sha256_file(local) == f.sha256:
            continue  # already here (a resumed pull)
        todo.append(DownloadItem(f"{info.tag}/{f.path}", temp_name(local, f.path), f.size))
    prog = Progress(progress, sum(i.size for i in todo))
    try:
        written = backend.download_files(todo, prog)  # each file's sha256, hashed as it arrived
        by_key = {f"{info.tag}/{f.path}": f for f in info.files}
        for item in todo:
            f = by_key[item.key]
            size = item.dest.stat().st_size
            if size != f.size or written.get(item.key) != f.sha256:
                raise VerificationError(f"shard {f.path} does not match its sha256")
            os.replace(item.dest, tag_dir / f.path)
    finally:
        for item in todo:
            item.dest.unlink(missing_ok=True)
    prog.finish()
