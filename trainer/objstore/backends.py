"""Storage backends for trainer.objstore: errors, shared helpers, hashing, and the local
directory (file://) backend; the S3 backend is in trainer.objstore.s3.

Both offer the same small set of operations on keys *relative to the store root*
(``step10/mp_rank_00_model_states.pt``, ``latest``); trainer.objstore builds the
checkpoint semantics (node markers, manifests, ``latest``) on top of them.

boto3 is imported only inside S3Backend, so importing this module stays cheap.
Error messages name the bucket/endpoint and the fix, never credentials.
"""

from __future__ import annotations

import base64
import builtins
import hashlib
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.objstore.atomic import atomic_write

ProgressFn = Callable[[int, int], None]


# --------------------------------------------------------------------------- errors
class StorageError(Exception):
    """A storage operation failed. ``transient`` says whether retrying may help."""

    transient = False


class StorageUnavailable(StorageError):
    """The store could not be reached or answered 5xx/throttling: retry later."""

    transient = True


class StorageAuthError(StorageError):
    """Credentials missing, wrong, or not allowed: retrying will not help."""


class StorageNotFound(StorageError):
    """The bucket (or a required object) does not exist."""


class InvalidTag(StorageError, ValueError):
    """A checkpoint tag that is not a plain name (it could address files outside its folder)."""


class UploadError(StorageError):
    """A background upload failed for good (raised by BackgroundUploader.wait)."""


class VerificationError(StorageError):
    """A downloaded file does not match the size/sha256 recorded in the manifest."""


class UnsafeManifest(StorageError):
    """A manifest or node marker that gpuctl would never write: a tag that is not the folder it
    sits in, a path that leaves its folder, a size or digest of the wrong shape. Anyone holding
    the bucket's write key (every rented node) can write one, so it is refused, never "fixed"."""


# --------------------------------------------------------------------------- helpers
@dataclass(frozen=True)
class ObjectStat:
    size: int
    mtime: float  # epoch seconds
    etag: str = ""  # S3's ETag, unquoted (the MD5 of a one-part object's bytes); "" for file://


@dataclass(frozen=True)
class UploadItem:
    local: Path
    key: str
    size: int
    sha256: str | None = None  # known when hashed before the upload; else hashed as it is sent


@dataclass(frozen=True)
class Uploaded:
    """One file's digests, hashed from the very buffers that were sent."""

    sha256: str
    composite: str | None = None  # S3's checksum of a multipart upload (digests.__doc__)
    md5: str | None = None  # up to ETAG_MAX bytes, or where the store keeps no checksum: its ETag


@dataclass(frozen=True)
class DownloadItem:
    key: str
    dest: Path  # a temporary path; the caller verifies and moves it into place
    size: int


class Progress:
    """Thread-safe byte counter that calls ``fn(done, total)``, at most every 0.1 s."""

    def __init__(self, fn: ProgressFn | None, total: int, interval: float = 0.1):
        self._fn, self.total, self._interval = fn, total, interval
        self.done = 0
        self._lock = threading.Lock()
        self._last = 0.0
        if fn:
            fn(0, total)

    def add(self, n: int) -> None:
        with self._lock:
            # s3transfer reports negative amounts when it rewinds a part to retry it.
            self.done = min(self.total, max(0, self.done + n))
            now = time.monotonic()
            if self._fn is None or (now - self._last < self._interval and self.done < self.total):
                return
            self._last = now
            done, total = self.done, self.total
        self._fn(done, total)

    def finish(self) -> None:
        with self._lock:
            self.done = self.total
        if self._fn:
            self._fn(self.total, self.total)


# --------------------------------------------------------------------------- hashing
_hash_cache: dict[tuple[str, int, int], str] = {}
_composite_cache: dict[tuple[str, int, int, int], str] = {}  # (path, size, mtime_ns, part size)
_hash_lock = threading.Lock()


def hash_file(path: Path, h: Any) -> str:
    """Feed the file through hashlib object `h` in 1 MiB reads; its hex digest."""
    buf = bytearray(1 << 20)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])  # hashlib releases the GIL on large buffers
    return str(h.hexdigest())


def sha256_file(path: Path) -> str:
    """sha256 of a file, cached on (absolute path, size, mtime_ns)."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    with _hash_lock:
        hit = _hash_cache.get(key)
    if hit is not None:
        return hit
    digest = hash_file(path, hashlib.sha256())
    with _hash_lock:
        _hash_cache[key] = digest
    return digest


def digests(path: Path, part_size: int | None) -> tuple[str, str | None]:
    """(sha256 hex, S3's composite SHA256 checksum) of a file in one read.

    The composite is what S3 reports for an object uploaded in parts of ``part_size`` bytes
    with ChecksumAlgorithm=SHA256: base64(sha256(part digest 1 + part digest 2 + ...)); None
    when ``part_size`` is None (a single-part upload, whose checksum is the plain sha256)."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    pkey = (key[0], key[1], key[2], part_size or 0)
    with _hash_lock:
        hit, composite = _hash_cache.get(key), _composite_cache.get(pkey)
    if hit is not None and (part_size is None or composite is not None):
        return hit, composite
    whole, parts = hashlib.sha256(), []
    part, in_part = hashlib.sha256(), 0
    buf = bytearray(1 << 20)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            whole.update(view[:n])
            if part_size is None:
                continue
            done = 0
            while done < n:
                take = min(n - done, part_size - in_part)
                part.update(view[done : done + take])
                done, in_part = done + take, in_part + take
                if in_part == part_size:
                    parts.append(part.digest())
                    part, in_part = hashlib.sha256(), 0
    if in_part:
        parts.append(part.digest())
    digest = whole.hexdigest()
    composite = None if part_size is None else base64.b64encode(hashlib.sha256(b"".join(parts)).digest()).decode()
    with _hash_lock:
        _hash_cache[key] = digest
        if composite is not None:
            _composite_cache[pkey] = composite
    return digest, composite


def part_checksums(
    part_size: Callable[[int], int | None], local: dict[str, Path], sizes: dict[str, int]
) -> dict[str, str]:
    """S3's composite checksum of each file that goes up in parts (publish checks the store's)."""
    parts = {rel: n for rel in local if (n := part_size(sizes[rel]))}
    if not parts:
        return {}
    with ThreadPoolExecutor(max_workers=min(4, len(parts))) as pool:
        found = pool.map(lambda rel: digests(local[rel], parts[rel])[1], list(parts))
        return {rel: c for rel, c in zip(parts, found, strict=True) if c}


ETAG_MAX = 1 << 20  # files up to this size also get an md5: S3 lists it as their ETag


def small_md5s(local: dict[str, Path], sizes: dict[str, int]) -> dict[str, str]:
    """The md5 of each file of at most ETAG_MAX bytes. A one-part object's ETag is the MD5 of
    its bytes (S3, and S3-compatible stores, without SSE-KMS), and LIST returns every ETag:
    a checkpoint's many small files are then vouched for by one LIST, not one HEAD each."""
    return {
        rel: hashlib.md5(p.read_bytes(), usedforsecurity=False).hexdigest()
        for rel, p in local.items()
        if sizes[rel] <= ETAG_MAX
    }


def md5_files(paths: dict[str, Path]) -> dict[str, str]:
    """The whole-file md5 of each path, in parallel (hashlib releases the GIL)."""

    def md5(path: Path) -> str:
        return hash_file(path, hashlib.md5(usedforsecurity=False))

    if not paths:
        return {}
    with ThreadPoolExecutor(max_workers=min(4, len(paths))) as pool:
        return dict(zip(paths, pool.map(md5, paths.values()), strict=True))


def _hash_many(paths: list[Path]) -> list[str]:
    if len(paths) <= 1:
        return [sha256_file(p) for p in paths]
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        return list(pool.map(sha256_file, paths))


# --------------------------------------------------------------------------- file://
class FileBackend:
    """A directory on a local (or network-mounted) filesystem. Writes are temp + os.replace."""

    _COPY_CHUNK = 8 << 20

    keeps_checksums: bool | None = True  # not S3: content_matches hashes the stored file

    def __init__(self, root: Path):
        if not root.is_absolute():
            raise ValueError(f"file:// storage needs an absolute path, got {root}")
        self.root = root
        self.url = f"file://{root}"

    def _path(self, key: str) -> Path:
        return self.root / key

    def list(self, prefix: str = "") -> dict[str, ObjectStat]:
        base = self._path(prefix) if prefix else self.root
        if not base.is_dir():
            return {}
        out: dict[str, ObjectStat] = {}
        for dirpath, _dirs, files in os.walk(base):
            for name in files:
                if name.startswith(".tmp-"):
                    continue
                p = Path(dirpath, name)
                try:
                    st = p.stat()
                except FileNotFoundError:  # deleted while listing
                    continue
                out[p.relative_to(self.root).as_posix()] = ObjectStat(st.st_size, st.st_mtime)
        return out

    def folders(self) -> builtins.list[str]:
        """The names of the folders at the store's root."""
        try:
            return [e.name for e in os.scandir(self.root) if e.is_dir()]
        except FileNotFoundError:
            return []

    def read_bytes(self, key: str) -> bytes | None:
        try:
            return self._path(key).read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None

    def write_bytes(self, key: str, data: bytes) -> None:
        atomic_write(self._path(key), data)

    def head_sha256(self, key: str) -> str | None:
        return None  # no object metadata on a plain directory: such files are copied again

    def part_size(self, size: int) -> int | None:
        return None  # files are copied whole

    def content_matches(
        self, key: str, size: int, sha256: str, composite: str | None, *, read_back: bool = True
    ) -> bool:
        """The stored file really holds these bytes (read back and hashed: a local disk)."""
        path = self._path(key)
        try:
            return path.stat().st_size == size and sha256_file(path) == sha256
        except (FileNotFoundError, NotADirectoryError):
            return False

    def delete(self, keys: Iterable[str]) -> None:
        for key in keys:
            self._path(key).unlink(missing_ok=True)

    def delete_prefix(self, prefix: str) -> None:
        shutil.rmtree(self._path(prefix), ignore_errors=True)

    def _copy(self, src: Path, dst: Path, progress: Progress) -> str:
        """Copy src to dst (temp + rename); the sha256 of the bytes copied."""
        dst.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=dst.parent)
        digest = hashlib.sha256()
        try:
            with open(src, "rb") as fin, os.fdopen(fd, "wb") as fout:
                while chunk := fin.read(self._COPY_CHUNK):
                    fout.write(chunk)
                    digest.update(chunk)
                    progress.add(len(chunk))
            os.replace(tmp, dst)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return digest.hexdigest()

    def upload_files(self, items: builtins.list[UploadItem], progress: Progress) -> dict[str, Uploaded]:
        """Copy each item into the store; each key's sha256 of the bytes copied (hashed in flight)."""
        out = {}
        for it in items:
            digest = self._copy(it.local, self._path(it.key), progress)
            if it.sha256 is not None and digest != it.sha256:
                raise OSError(f"{it.local} changed while uploading (its sha256 is not the one hashed before)")
            out[it.key] = Uploaded(digest)
        return out

    def download_files(self, items: builtins.list[DownloadItem], progress: Progress) -> dict[str, str]:
        """Copy each item to its dest; each key's sha256 of the bytes written (hashed in flight)."""
        out = {}
        for it in items:
            src = self._path(it.key)
            if not src.is_file():
                raise StorageNotFound(f"{self.url}/{it.key} is missing")
            out[it.key] = self._copy(src, it.dest, progress)
        return out
