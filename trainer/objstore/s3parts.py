"""Bulk S3 uploads for S3Backend (downloads: s3download.py): multipart upload on a thread
pool, each part one request whose body is one buffer.

Why not boto3's transfer manager: it hands botocore a file object that http.client sends in
8-16 KiB reads, it hashes every part again for ChecksumAlgorithm=SHA256 (we hash each buffer
once and keep its digest), and its download writes through a queue and is
hashed again afterwards. On a 2-core node every pass over the bytes is CPU the training and
the other transfers need (benchmarks/bench_storage.py measures it against s5cmd). The CRT
transfer client (awscrt) would do all of this in C, but boto3 builds it without the client's
endpoint_url and the CRT cannot resolve a host:port endpoint (boto/boto3#4839), so it cannot
talk to the S3-compatible stores we support.

Upload: a part is read (pread, page cache) into one buffer, hashed (its SHA256 goes with it:
S3 checks it and keeps the composite publish compares) and sent; the same buffers, in file
order, make the whole-file sha256 (and md5 where the store keeps no checksum), so a file is
read once and there is no hashing pass before the first byte goes out. A one-PUT file is
hashed whole before it is sent. The buffers alive at once are bounded by ``max_buffer`` bytes
(S3Options). The payload itself is not signed (s3.py): botocore would hash it once more.

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
from functools import partial
from pathlib import Path
from typing import Any

from trainer.objstore.backends import ETAG_MAX, Progress, Uploaded, UploadItem, VerificationError
from trainer.objstore.layout import MD5_RE


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


class Batch:
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
class Answers:
    """Whether the store keeps the SHA256 checksums it is sent (None: not known yet), from its
    answers: a one-part PUT's echoes the kept checksum, a CreateMultipartUpload's the algorithm
    (moto and S3 do both, rclone serve s3 neither; a part's answer carries the checksum on S3 but
    not on moto, so parts do not count). A store without checksums needs each file's md5 in its
    marker: publish compares it with the ETag."""

    def __init__(self, kept: bool | None):
        self.kept, self._lock = kept, threading.Lock()

    def saw(self, resp: dict[str, Any]) -> bool:
        """Whether this answer says the checksum is kept."""
        kept = bool(resp.get("ChecksumSHA256") or resp.get("ChecksumAlgorithm"))
        with self._lock:  # workers answer at once; one "not kept" must not be lost
            self.kept = kept if self.kept is None else self.kept and kept
        return kept


class CorruptUpload(VerificationError):
    """The store holds other bytes than were sent (its ETag, the MD5 of what it stored, is not
    ours, and a read-back confirms it). The object is deleted: the next attempt sends it again."""

    transient = True


def read_back_sha256(client: Any, bucket: str, key: str) -> str:
    digest = hashlib.sha256()
    for chunk in client.get_object(Bucket=bucket, Key=key)["Body"].iter_chunks(1 << 20):
        digest.update(chunk)
    return digest.hexdigest()


def _check_etag(client: Any, bucket: str, key: str, etag: str, got: Uploaded) -> None:
    """Where the file was md5'd (the store keeps no checksum, or the file is small), the ETag
    vouches for the stored bytes as soon as they are stored (publish checks again, from its
    listing). An ETag that is not a plain MD5 (a multipart "-N" one) says nothing: publish reads
    the object back. One that differs is confirmed by a read-back before the object is called
    corrupt (SSE-KMS and SSE-C make ETags that are not the MD5 of the bytes)."""
    etag = etag.strip('"')
    if got.md5 is None or etag == got.md5 or not MD5_RE.match(etag):
        return
    if read_back_sha256(client, bucket, key) == got.sha256:
        return
    try:
        client.delete_object(Bucket=bucket, Key=key)
    except Exception:  # noqa: BLE001 - best effort: publish refuses it anyway
        pass
    raise CorruptUpload(f"{key}: the store holds other bytes than were sent (ETag {etag}, md5 {got.md5})")


class _WholeFile:
    """Whole-file digests of a file sent in parts, from the part buffers themselves (the file
    is read once): a part is fed to sha256 (and md5 where the store keeps no checksum) once it
    and every part before it were sent, by whichever worker completes the run, and its buffer is
    freed (budget given back) once hashed. Parts sent ahead of a slow one wait in memory,
    within the budget they already hold. The worker that hashes the last part calls ``done``:
    the file is completed while the other files are still going up."""

    def __init__(self, n_parts: int, budget: _Budget, checksummed: bool, done: Callable[[_WholeFile], None]):
        self.sha256 = hashlib.sha256()
        self.md5: Any = None if checksummed else hashlib.md5(usedforsecurity=False)
        self.part_digests: list[bytes] | None = [b""] * n_parts if checksummed else None
        self.part_answers: list[dict[str, Any]] = [{}] * n_parts
        self._n, self._budget, self._done = n_parts, budget, done
        self._held, self._next = dict[int, bytes](), 0
        self._active, self._lock = False, threading.Lock()

    def sent(self, index: int, data: bytes, digest: bytes, answer: dict[str, Any]) -> None:
        with self._lock:
            self._held[index], self.part_answers[index] = data, answer
            if self.part_digests is not None:
                self.part_digests[index] = digest
            if self._active:
                return  # the worker hashing now will get to it
            self._active = True
        while True:
            with self._lock:
                data = self._held.pop(self._next, b"")
                if not data:
                    self._active = False
                    return
                self._next += 1
            self.sha256.update(data)
            if self.md5 is not None:
                self.md5.update(data)
            self._budget.give(len(data))
            if self._next == self._n:
                self._done(self)

    def result(self, it: UploadItem) -> Uploaded:
        digest = self.sha256.hexdigest()
        if it.sha256 is not None and digest != it.sha256:
            raise OSError(f"{it.local} changed while uploading (its sha256 is not the one hashed before)")
        composite = _b64(hashlib.sha256(b"".join(self.part_digests)).digest()) if self.part_digests else None
        return Uploaded(digest, composite, self.md5.hexdigest() if self.md5 is not None else None)


def upload(
    client: Any,
    bucket: str,
    key_of: Callable[[str], str],
    items: list[UploadItem],
    part_size: Callable[[int], int | None],
    concurrency: int,
    max_buffer: int,
    progress: Progress,
    answers: Answers,
) -> dict[str, Uploaded]:
    """Upload ``items``, hashing each buffer as it goes (read once); raises the first
    botocore/OS error. Each key's digests; ``answers`` learns whether the store keeps checksums.
    A multipart file is completed by the worker that sent (and hashed) its last part."""
    batch = Batch(concurrency)
    budget = _Budget(max_buffer, batch.failed)
    lock = threading.Lock()
    open_uploads: dict[str, str] = {}  # key -> UploadId, until completed
    out: dict[str, Uploaded] = {}
    whole: dict[str, Future[Any]] = {}

    def complete(it: UploadItem, key: str, upload_id: str, hasher: _WholeFile) -> None:
        got = hasher.result(it)  # a file changed since it was hashed is aborted, not completed
        parts = {"Parts": hasher.part_answers}
        client.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload=parts)
        with lock:
            del open_uploads[key]
        if got.md5 is not None:  # rclone serve s3 hashes the object now, while the rest goes up
            _check_etag(client, bucket, key, client.head_object(Bucket=bucket, Key=key).get("ETag", ""), got)
        with lock:
            out[it.key] = got

    try:
        for it in sorted(items, key=lambda it: part_size(it.size) is not None):  # one-part files first
            if batch.failed.is_set():
                break
            key, psize = key_of(it.key), part_size(it.size)
            if psize is None:
                if not budget.take(it.size):
                    break
                whole[it.key] = batch.submit(_put_whole, client, bucket, key, it, progress, budget, answers)
                continue
            meta = {"sha256": it.sha256} if it.sha256 else {}  # known only when hashed before
            resp = client.create_multipart_upload(Bucket=bucket, Key=key, Metadata=meta, ChecksumAlgorithm="SHA256")
            with lock:
                open_uploads[key] = upload_id = resp["UploadId"]
            n_parts, kept_before = -(-it.size // psize), answers.kept
            checksummed = answers.saw(resp) or kept_before is True  # parts carry one unless the store keeps none
            hasher = _WholeFile(n_parts, budget, checksummed, partial(complete, it, key, upload_id))
            for n in range(n_parts):
                size = min(psize, it.size - n * psize)
                if not budget.take(size):
                    break
                args = (client, bucket, key, upload_id, n, it.local, n * psize, size, hasher, progress, budget)
                batch.submit(_put_part, *args)
        exc = batch.finish()
        if exc is not None:
            raise exc
        return out | {k: f.result() for k, f in whole.items()}
    finally:
        batch.pool.shutdown(wait=True, cancel_futures=True)
        for key, upload_id in open_uploads.items():  # best effort: the server may be down
            try:
                client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)
            except Exception:  # noqa: BLE001 - the original error is the one to report
                pass


def _put_whole(
    client: Any, bucket: str, key: str, it: UploadItem, progress: Progress, budget: _Budget, answers: Answers
) -> Uploaded:
    """One PUT, hashed from its one buffer (and md5'd where its ETag is to vouch for it)."""
    try:
        data = Path(it.local).read_bytes()
        if len(data) != it.size:
            raise OSError(f"{it.local} changed size while uploading ({it.size} -> {len(data)} bytes)")
        sha = hashlib.sha256(data).digest()
        if it.sha256 is not None and sha.hex() != it.sha256:
            raise OSError(f"{it.local} changed while uploading (its sha256 is not the one hashed before)")
        resp = client.put_object(  # ChecksumAlgorithm too: some stores (moto) keep the checksum only then
            Bucket=bucket,
            Key=key,
            Body=data,
            Metadata={"sha256": sha.hex()},
            ChecksumAlgorithm="SHA256",
            ChecksumSHA256=_b64(sha),
        )
        kept = answers.saw(resp)
        md5 = hashlib.md5(data, usedforsecurity=False).hexdigest() if len(data) <= ETAG_MAX or not kept else None
    finally:
        budget.give(it.size)
    got = Uploaded(sha.hex(), None, md5)
    _check_etag(client, bucket, key, resp.get("ETag", ""), got)  # where md5'd (moto keeps a checksum unchecked)
    progress.add(len(data))
    return got


def _put_part(
    client: Any,
    bucket: str,
    key: str,
    upload_id: str,
    index: int,
    path: Path,
    offset: int,
    size: int,
    hasher: _WholeFile,
    progress: Progress,
    budget: _Budget,
) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            data = os.pread(fd, size, offset)
        finally:
            os.close(fd)
        if len(data) != size:
            raise OSError(f"{path} changed size while uploading (short read at {offset})")
        answer: dict[str, Any] = {"PartNumber": index + 1}
        digest = b""
        if hasher.part_digests is not None:  # S3 verifies it and keeps it (the payload is not signed: s3.py)
            digest = hashlib.sha256(data).digest()
            answer["ChecksumSHA256"] = _b64(digest)
        resp = client.upload_part(Bucket=bucket, Key=key, UploadId=upload_id, Body=data, **answer)
    except BaseException:
        budget.give(size)
        raise
    progress.add(len(data))
    answer["ETag"] = resp["ETag"]
    hasher.sent(index, data, digest, answer)  # gives the budget back once hashed in order
