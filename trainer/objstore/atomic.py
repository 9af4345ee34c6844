"""One way to write a file: all of it or none of it, with its final mode from the start.

Used on the node (checkpoint markers, manifests) and on the laptop (state records, keys,
bundles): a reader sees the old file or the new one, never half of one, and a file meant to be
0600 is never readable by others, not even for a moment (mkstemp creates 0600; only a wider mode
is set, before the rename makes the file visible).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def atomic_write(path: Path, data: bytes | str, mode: int = 0o644) -> None:
    """Write data to path via a temp file in the same folder, fsync and os.replace."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data.encode() if isinstance(data, str) else data)
            fh.flush()
            os.fsync(fh.fileno())
        if mode != 0o600:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
