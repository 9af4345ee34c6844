"""Bulk S3 transfers for S3Backend: multipart upload and ranged download on a thread pool,
each part one request whose body is one buffer.

Why not boto3's transfer manager: it hands botocore a file object that http.client sends in
8-16 KiB reads, it hashes every part again for ChecksumAlgorithm=SHA256 (we hashed it already:
backends.digests keeps each part's digest), and its download writes through a queue and is
hashed again afterwards. On a 2-core node every pass over the bytes is CPU the training and
the other transfers need (benchmarks/bench_storage.py measures it against s5cmd). The CRT
transfer client (awscrt) would do all of this in C, but boto3 builds it without the client's
endpoint_url and the CRT cannot resolve a host:port endpoint (boto/boto3#4839), so it cannot
talk to the S3-compatible stores we support.

Upload: a part is read (pread, page cache) into one buffer and sent with its precomputed
SHA256 (S3 checks it and keeps the composite publish compares); the parts alive at once are
bounded by ``max_buffer`` bytes (S3Options). Download: a file is one GET, or a few long
ranged GETs (one per connection), streamed to disk with pwrite in STREAM_CHUNK pieces; each
range is hashed into the file's sha256 as soon as the ranges before it are on disk, from the
page cache, so the file is verified while the rest still arrives. Memory: one chunk per
connection.
Retries are botocore's (standard mode) per request; the first failure cancels the rest,
aborts the unfinished multipart uploads and is raised to S3Backend, which maps it.
"""

from __future__ import annotations

import base64
import hashlib
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from trainer.objstore.backends import DownloadItem, Progress, UploadItem, part_digests


def _b64(digest: bytes) -> str:
    return base64.b64encode(digest).decode()


class _Budget:
    """Bytes of part buffers alive at once: ``take`` waits (in the submitting thread, in order)
    until ``give`` frees room; one part larger than the whole budget still goes, alone."""

    def __init__(self, limit: int, failed: threading.Event):
        self._limit, self._used, self._failed = limit, 0, failed
        self._cond = threading.Condition()

    def take(self, n: int) -> bool:
        """False when the batch failed while waiting (stop submitting)."""
        with self._cond:
            while self._used and self._used + n > self._limit:
                if self._failed.is_set():
                    return False
                self._cond.wait(timeout=0.5)
            self._used += n
            return not self._failed.is_set()

    def give(self, n: int) -> None:
        with self._cond:
            self._used -= n
            self._cond.notify_all()


class _Batch:
    """A pool of ``workers`` threads; the first exception cancels what has not started."""

    def __init__(self, workers: int):
        self.pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="gpuctl-s3")
        self.futures: list[Future[Any]] = []
        self.failed = threading.Event()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        def run() -> Any:
            if self.failed.is_set():
                return None
            try:
                return fn(*args)
            except BaseException:
                self.failed.set()
                raise

        fut = self.pool.submit(run)
        self.futures.append(fut)
        return fut

    def finish(self) -> BaseException | None:
        """Wait for everything; the first exception (None when all succeeded)."""
        first: BaseException | None = None
        for fut in self.futures:
            if fut.cancelled():
                continue
            exc = fut.exception()
            if exc is not None and first is None:
                first = exc
                for other in self.futures:
                    other.cancel()
        self.pool.shutdown(wait=True)
        return first


# --------------------------------------------------------------------------- upload
def upload(
    client: Any,
    bucket: str,
    key_of: Callable[[str], str],
    items: list[UploadItem],
    part_size: Callable[[int], int | None],
    concurrency: int,
    max_buffer: int,
    progress: Progress,
) -> bool:
    """Upload ``items`` (their sha256 known); raises the first botocore/OS error. True when
    the store answered every request with the SHA256 checksum it verified and keeps."""
    batch = _Batch(concurrency)
    budget = _Budget(max_buffer, batch.failed)
    open_uploads: dict[str, str] = {}  # key -> UploadId, until completed
    completions: list[tuple[str, str, list[Future[Any]]]] = []
    try:
        for it in items:
            if batch.failed.is_set():
                break
            key, meta = key_of(it.key), {"sha256": it.sha256}
            psize = part_size(it.size)
            if psize is None:
                if not budget.take(it.size):
                    break
                batch.submit(_put_whole, client, bucket, key, it, meta, progress, budget)
                continue
            digests = part_digests(it.local, psize)
            upload_id = client.create_multipart_upload(
                Bucket=bucket, Key=key, Metadata=meta, ChecksumAlgorithm="SHA256"
            )["UploadId"]
            open_uploads[key] = upload_id
            parts = []
            for n, digest in enumerate(digests):
                size = min(psize, it.size - n * psize)
                if not budget.take(size):
                    break
                args = (client, bucket, key, upload_id, n + 1, it.local, n * psize, size, digest, progress, budget)
                parts.append(batch.submit(_put_part, *args))
            completions.append((key, upload_id, parts))
        exc = batch.finish()
        if exc is not None:
            raise exc
        for key, upload_id, parts in completions:
            done = [f.result()[0] for f in parts]
            client.complete_multipart_upload(
                Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": done}
            )
            del open_uploads[key]
        return all(f.result()[1] for f in batch.futures)
    finally:
        batch.pool.shutdown(wait=True, cancel_futures=True)
        for key, upload_id in open_uploads.items():  # best effort: the server may be down
            try:
                client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)
            except Exception:  # noqa: BLE001 - the original error is the one to report
                pass


def _put_whole(
    client: Any, bucket: str, key: str, it: UploadItem, meta: dict[str, str], progress: Progress, budget: _Budget
) -> tuple[None, bool]:
    """One PUT; (None, whether the store kept its SHA256 checksum)."""
    try:
        data = Path(it.local).read_bytes()
        if len(data) != it.size:
            raise OSError(f"{it.local} changed size while uploading ({it.size} -> {len(data)} bytes)")
        sha = _b64(bytes.fromhex(it.sha256))
        resp = client.put_object(Bucket=bucket, Key=key, Body=data, Metadata=meta, ChecksumSHA256=sha)
    finally:
        budget.give(it.size)
    progress.add(len(data))
    return None, bool(resp.get("ChecksumSHA256"))


def _put_part(
    client: Any,
    bucket: str,
    key: str,
    upload_id: str,
    number: int,
    path: Path,
    offset: int,
    size: int,
    digest: bytes,
    progress: Progress,
    budget: _Budget,
) -> tuple[dict[str, Any], bool]:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            data = os.pread(fd, size, offset)
        finally:
            os.close(fd)
        if len(data) != size:
            raise OSError(f"{path} changed size while uploading (short read at {offset})")
        resp = client.upload_part(
            Bucket=bucket,
            Key=key,
            UploadId=upload_id,
            PartNumber=number,
            Body=data,
            ChecksumSHA256=_b64(digest),  # S3 verifies it; botocore does not hash again
        )
    finally:
        budget.give(size)
    progress.add(len(data))
    kept = bool(resp.get("ChecksumSHA256"))  # absent: the store ignores checksums (rclone serve s3)
    return {"PartNumber": number, "ETag": resp["ETag"], "ChecksumSHA256": _b64(digest)}, kept


# --------------------------------------------------------------------------- download
STREAM_CHUNK = 4 << 20  # a download connection holds one such buffer at a time
MIN_RANGE = 64 << 20  # a shorter range costs more in requests than it gains in parallelism
STREAM_ATTEMPTS = 5  # a long range cut mid-body resumes where it stopped (as s3transfer does)


class _InOrderHash:
    """sha256 of a file whose ranges are written in any order: once a range and all before
    it are on disk, one worker hashes them, read back from the page cache they were just
    written to (a memcpy, no disk I/O), while the other ranges go on downloading."""

    def __init__(self, fd: int, ranges: list[tuple[int, int]]):
        self.digest = hashlib.sha256()
        self._fd, self._ranges = fd, ranges
        self._next, self._done, self._active = 0, set[int](), False
        self._lock = threading.Lock()

    def written(self, index: int) -> None:
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
    batch = _Batch(concurrency)
    hashes: dict[str, _InOrderHash] = {}
    fds: list[int] = []
    try:
        for it, ranges in zip(items, ranges_for(items, part_size, concurrency), strict=True):
            it.dest.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(it.dest, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            fds.append(fd)
            os.ftruncate(fd, it.size)
            hashes[it.key] = h = _InOrderHash(fd, ranges)
            whole = len(ranges) == 1
            for n, (start, length) in enumerate(ranges):
                batch.submit(_get_range, client, bucket, key_of(it.key), fd, n, start, length, whole, h, progress)
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
    whole: bool,
    hasher: _InOrderHash,
    progress: Progress,
) -> None:
    from botocore.exceptions import HTTPClientError

    got, attempt = 0, 1
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
