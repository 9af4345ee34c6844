"""A run bundle shipped and started in one SSH exec channel (issue 37: `train` within half a second
of ssh by hand).

SFTP costs two round trips per file and one per folder (the bundle's trainer package alone is
dozens of files), then start_detached opens a channel of its own. Here the bundle travels as a tar
stream on the stdin of one remote `bash -c`, which unpacks it and starts launch.sh detached: one
channel, no per-file round trip. What put_dir guarantees holds: ignored files stay home (the same
walk_shipped), folders are 0700, and every file is created under umask 077 and only then gets its
mode (tar -p), so a 0600 secrets.env is never readable by others, and its values never reach argv.
A node without tar answers 95 before reading a byte: the caller falls back to SFTP.
"""

from __future__ import annotations

import os
import stat
import tarfile
from pathlib import Path

import paramiko

from provision.transport.ignore import walk_shipped
from provision.transport.remote import DETACH_SCRIPT

NO_TAR = 95  # the node has no tar: ship over SFTP instead
UNPACK_FAILED = 96
# $1 run dir, $2 script, $3 log (DETACH_SCRIPT's own arguments). The umask lives in the subshell
# only: the run itself keeps the login's umask, as it does when started by start_detached.
SHIP_SCRIPT = (
    f"command -v tar >/dev/null 2>&1 || exit {NO_TAR}; "
    '( umask 077 && mkdir -p -- "$1" && exec tar -x -p --no-same-owner -f - -C "$1" ) '
    f"|| {{ echo 'unpacking the bundle failed' >&2; exit {UNPACK_FAILED}; }}; " + DETACH_SCRIPT
)


class ChannelFile:
    """The write end tarfile's stream mode needs, over an exec channel's stdin. A write after the
    node closed its side stops the stream (`broken`); the exit status then says why."""

    def __init__(self, chan: paramiko.Channel):
        self.chan = chan
        self.broken: BaseException | None = None

    def write(self, data: bytes) -> int:
        if self.broken is None:
            try:
                self.chan.sendall(data)
            except (OSError, EOFError, paramiko.SSHException) as exc:
                self.broken = exc
        return len(data)


def write_tar(local: Path, out: ChannelFile) -> None:
    """What put_dir would copy, as one tar stream: folders 0700, files with their own mode, links as links."""
    with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT, bufsize=1 << 16) as tar:  # type: ignore[call-overload]
        for rel, path, kind in walk_shipped(local):
            if out.broken is not None:
                return
            st = os.lstat(path)
            info = tarfile.TarInfo(rel)
            info.mtime = int(st.st_mtime)
            if kind == "dir":
                info.type, info.mode = tarfile.DIRTYPE, 0o700
                tar.addfile(info)
            elif kind == "link":
                info.type, info.mode, info.linkname = tarfile.SYMTYPE, 0o777, os.readlink(path)
                tar.addfile(info)
            else:
                info.size, info.mode = st.st_size, stat.S_IMODE(st.st_mode)
                with open(path, "rb") as fh:
                    tar.addfile(info, fh)
