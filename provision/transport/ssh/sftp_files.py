"""SFTP helpers of SSHNode: files put with their mode set before the first byte, folders made 0700."""

from __future__ import annotations

import posixpath
import stat
from pathlib import Path

import paramiko


def _sftp_put(sftp: paramiko.SFTPClient, path: Path, target: str) -> None:
    """One file in ~2 round trips (open, close; writes pipelined, their errors raised at close).
    A mode other than the usual 0644 (secrets.env: 0600) is set while the file is still empty,
    before the first byte goes out: a secret never sits in a file others may read."""
    mode = stat.S_IMODE(path.stat().st_mode)
    with open(path, "rb") as src, sftp.open(target, "wb") as dst:
        if mode != 0o644:
            dst.chmod(mode)
        dst.set_pipelined(True)
        while chunk := src.read(1 << 20):
            dst.write(chunk)


def _sftp_mkdir(sftp: paramiko.SFTPClient, path: str, mode: int) -> None:
    try:
        sftp.mkdir(path, mode)
    except OSError:
        if not stat.S_ISDIR(sftp.stat(path).st_mode):
            raise


def _sftp_makedirs(sftp: paramiko.SFTPClient, path: str) -> None:
    parts = [p for p in path.split("/") if p]
    current = "/" if path.startswith("/") else ""
    for part in parts:
        current = posixpath.join(current, part) if current else part
        try:
            sftp.stat(current)
        except FileNotFoundError:
            _sftp_mkdir(sftp, current, 0o700)


def _sftp_remove(sftp: paramiko.SFTPClient, path: str) -> None:
    try:
        sftp.remove(path)
    except FileNotFoundError:
        pass
