"""Bulk S3 downloads for S3Backend, on s3parts' thread pool.

Download: a file is one GET, or a few long ranged GETs (one per connection), streamed to disk
with pwrite in STREAM_CHUNK pieces; each range is hashed into the file's sha256 as soon as the
ranges before it are on disk, from the page cache, so the file is verified while the rest
still arrives. Memory: one chunk per connection.
Retries are botocore's (standard mode) per request; a range cut mid-body goes on from the
last byte written; the first failure cancels the rest and is raised to S3Backend, which maps it.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable
from typing import Any

from trainer.objstore.backends import DownloadItem, Progress
from trainer.objstore.s3parts import Batch

STREAM_CHUNK = 4 << 20  # a download connection holds one such buffer at a time
MIN_RANGE = 64 << 20  # a shorter range costs more in requests than it gains in parallelism
STREAM_ATTEMPTS = 5  # a long range cut mid-body resumes where it stopped (as s3transfer does)


class _InOrderHash:
    """sha256 of a file whose ranges are written in any order: once a range and all before
    it are on disk, one worker hashes them, read back from the page cache they were just
    written to (a memcpy, no disk I/O), while the other ranges go on downloading. A file of
    one range (one GET, ``whole``) is hashed from the chunks themselves as they arrive: nothing to reorder."""

    def __init__(self, fd: int, ranges: list[tuple[int, int]]):
        self.digest = hashlib.sha256()
        self.whole = len(ranges) == 1
        self._fd, self._ranges = fd, ranges
        self._next, self._done, self._active = 0, set[int](), False
        self._lock = threading.Lock()

    def written(self, index: int) -> None:
        if self.whole:
            return
        with self._lock:
            self._done.add(index)
            if self._active:
                return  # the worker hashing now will get to it
            self._active = True
        while True:
            with self._lock:
                if self._next not in self._done:
                    self._active = False
                    return
                start, length = self._ranges[self._next]
            for off in range(start, start + length, STREAM_CHUNK):
                self.digest.update(os.pread(self._fd, min(STREAM_CHUNK, start + length - off), off))
            with self._lock:
                self._next += 1


def ranges_for(
    items: list[DownloadItem], part_size: Callable[[int], int | None], concurrency: int
) -> list[list[tuple[int, int]]]:
    """Each file's byte ranges, one GET each: a file below the multipart threshold is one
    GET; larger files share the ``concurrency`` connections in proportion to their size, in
    ranges of at least MIN_RANGE bytes, so each connection streams one long range. Few
    requests: a server that reads the whole object for each ranged GET (moto does) is not
    made to read it many times, and real S3 gives each connection its full speed on a range."""
    large = sum(it.size for it in items if part_size(it.size))
    out = []
    for it in items:
        if not part_size(it.size):
            out.append([(0, it.size)])
            continue
        n = max(1, min(round(concurrency * it.size / large), it.size // MIN_RANGE))
        step = -(-it.size // n)
        out.append([(start, min(step, it.size - start)) for start in range(0, it.size, step)])
    return out


def download(
    client: Any,
    bucket: str,
    key_of: Callable[[str], str],
    items: list[DownloadItem],
    part_size: Callable[[int], int | None],
    concurrency: int,
    progress: Progress,
) -> dict[str, str]:
    """Download ``items`` to their dest; returns each key's sha256 (hex) of the bytes written."""
    batch = Batch(concurrency)
    hashes: dict[str, _InOrderHash] = {}
    fds: list[int] = []
    try:
        for it, ranges in zip(items, ranges_for(items, part_size, concurrency), strict=True):
            it.dest.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(it.dest, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            fds.append(fd)
            os.ftruncate(fd, it.size)
            hashes[it.key] = h = _InOrderHash(fd, ranges)
            for n, (start, length) in enumerate(ranges):
                batch.submit(_get_range, client, bucket, key_of(it.key), fd, n, start, length, h, progress)
        exc = batch.finish()
        if exc is not None:
            raise exc
    finally:
        batch.pool.shutdown(wait=True, cancel_futures=True)
        for fd in fds:
            os.close(fd)
    return {key: h.digest.hexdigest() for key, h in hashes.items()}


def _get_range(
    client: Any,
    bucket: str,
    key: str,
    fd: int,
    index: int,
    start: int,
    length: int,
    hasher: _InOrderHash,
    progress: Progress,
) -> None:
    from botocore.exceptions import HTTPClientError

    got, attempt, whole = 0, 1, hasher.whole
    while True:
        if whole:  # one GET (also an empty object, which has no byte range)
            resp = client.get_object(Bucket=bucket, Key=key)
        else:
            resp = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={start + got}-{start + length - 1}")
        try:
            for chunk in resp["Body"].iter_chunks(STREAM_CHUNK):
                if got + len(chunk) > length:  # a store is untrusted: never write past the manifest's size
                    raise OSError(f"{key} is longer than its manifest says ({length} bytes from {start}): refused")
                os.pwrite(fd, chunk, start + got)
                if whole:
                    hasher.digest.update(chunk)
                got += len(chunk)
                progress.add(len(chunk))
            break
        except HTTPClientError:  # cut mid-body: botocore retried the request, not the stream
            if whole or attempt >= STREAM_ATTEMPTS:
                raise
            attempt += 1  # go on from the last byte written
    if got != length:
        raise OSError(f"short read of {key} bytes {start}-{start + length - 1}: got {got}")
    hasher.written(index)
