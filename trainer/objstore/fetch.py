"""Downloading one complete checkpoint into ``dest/<tag>``, every file verified.

The manifest was checked when it was read (layout.manifest_info); here every destination is
checked to stay inside ``dest`` before a byte is written, sizes are compared with the store's
listing, and each file lands under a temporary name and is moved into place only once its
size and sha256 match (the backend hashes the bytes as it writes them: no second read). Files already there with the right digest are kept (a resumed pull).
"""

from __future__ import annotations

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


def fetch_tag(backend: FileBackend | S3Backend, info: CheckpointInfo, dest: Path, progress: ProgressFn | None) -> None:
    """Download checkpoint ``info`` into dest/<tag>; VerificationError / StorageNotFound when a
    file is missing or wrong (a tag folder this call created is removed again)."""
    tag_dir = dest / info.tag
    inside(dest, [tag_dir / f.path for f in info.files])  # before anything is written
    created = not tag_dir.exists()
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
        # the pid: two nodes on a shared file system (NFS) may fetch into one folder at once
        todo.append(DownloadItem(f"{info.tag}/{f.path}", local.with_name(f".tmp-{os.getpid()}-{local.name}"), f.size))
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
    except (VerificationError, StorageNotFound):
        if created:
            shutil.rmtree(tag_dir, ignore_errors=True)
        raise
    finally:
        for item in todo:
            item.dest.unlink(missing_ok=True)
    prog.finish()
