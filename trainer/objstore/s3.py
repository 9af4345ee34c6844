"""The S3 backend of trainer.objstore: boto3's client, our own bulk transfers (s3parts.py
uploads, s3download.py downloads), botocore's standard retry mode, and errors that name the
bucket/endpoint and the fix but never credentials. boto3 is imported inside the class only
(the laptop CLI starts fast).
"""

from __future__ import annotations

import builtins
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from trainer.objstore import s3download, s3parts
from trainer.objstore.backends import (
    DownloadItem,
    ObjectStat,
    Progress,
    StorageAuthError,
    StorageError,
    StorageNotFound,
    StorageUnavailable,
    Uploaded,
    UploadItem,
)

_AUTH_CODES = {
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "TokenRefreshRequired",
    "AllAccessDisabled",
    "AccountProblem",
    "Forbidden",
    "403",
    "401",
    "Unauthorized",
    "UnauthorizedAccess",
}
_T = TypeVar("_T")

_THROTTLE_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestTimeout",
    "ServiceUnavailable",
    "InternalError",
}


@dataclass(frozen=True)
class S3Options:
    """Tuning for S3Backend; every field can be set in the ``storage`` config dict."""

    multipart_threshold: int = 64 << 20  # files above this go multipart
    multipart_chunksize: int = 32 << 20  # part size
    max_concurrency: int = 16  # parallel requests per transfer batch (parts and files)
    max_buffer: int = 256 << 20  # bytes of parts held in memory at once (upload and download)
    max_attempts: int = 4  # botocore attempts per request (standard retry mode)
    connect_timeout: float = 5.0
    read_timeout: float = 60.0


class S3Backend:
    """An S3 bucket/prefix: boto3's client, s3parts' threads and parts, botocore's retries."""

    def __init__(
        self,
        bucket: str,
        prefix: str,
        endpoint_url: str | None = None,
        region: str | None = None,
        profile: str | None = None,
        options: S3Options = S3Options(),
    ):
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.endpoint_url, self.region, self.profile = endpoint_url, region, profile
        self.options = options
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self._client: Any = None  # boto3 ships no type information
        # Whether the store keeps the SHA256 checksums we send (None: no upload yet). One that
        # does not (rclone serve s3) gets whole-file MD5s in the node marker: a listed ETag
        # that equals one vouches for the bytes, where a read-back would cost a download.
        self.keeps_checksums: bool | None = None
        self._client_lock = threading.Lock()

    # -- client (lazy: boto3 costs ~0.3 s to import) ---------------------------------
    @property
    def client(self) -> Any:
        with self._client_lock:
            if self._client is None:
                self._client = self._make_client()
            return self._client

    def _make_client(self) -> Any:
        import boto3
        from botocore import exceptions as bx
        from botocore.config import Config

        o = self.options
        try:
            session = boto3.session.Session(profile_name=self.profile)
        except bx.ProfileNotFound:
            raise StorageAuthError(
                f"AWS profile {self.profile!r} not found for {self.url}: "
                "check storage.profile / AWS_PROFILE and ~/.aws/config"
            ) from None
        cfg = Config(
            region_name=self.region or session.region_name or "us-east-1",
            retries={"mode": "standard", "total_max_attempts": o.max_attempts},
            connect_timeout=o.connect_timeout,
            read_timeout=o.read_timeout,
            max_pool_connections=o.max_concurrency + 4,
            # S3-compatible stores (R2, MinIO, older gateways) may reject the CRC32
            # trailers boto3 adds by default; we carry our own sha256 instead.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            # Every PUT carries its sha256 as x-amz-checksum-sha256, a signed header the store
            # verifies (and publish checks end to end where it keeps none): signing the payload
            # as well would make botocore hash every part a second time, over https too
            # (it skips that only for its own checksums, not for ones the caller sends).
            s3={"payload_signing_enabled": False} | ({"addressing_style": "path"} if self.endpoint_url else {}),
        )
        client = session.client("s3", endpoint_url=self.endpoint_url, config=cfg)
        return client

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _error(self, exc: BaseException, what: str) -> StorageError:
        """Map a botocore exception to a StorageError with a fix, no secrets."""
        from botocore import exceptions as bx

        where = f"{self.url}" + (f" (endpoint {self.endpoint_url})" if self.endpoint_url else "")
        if isinstance(exc, bx.ClientError):
            err = exc.response.get("Error", {})
            code = str(err.get("Code", ""))
            status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
            if code in _AUTH_CODES or status in (401, 403):
                return StorageAuthError(
                    f"S3 access denied for {where} while {what} ({code or status}): "
                    "check AWS_PROFILE / AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY "
                    "and that the key may read and write this bucket"
                )
            if code == "NoSuchBucket":
                return StorageNotFound(
                    f"S3 bucket {self.bucket!r} does not exist at {where}: "
                    "create it or fix storage.url / storage.endpoint_url"
                )
            if code in ("NoSuchKey", "404", "NotFound"):
                return StorageNotFound(f"{where}: object missing while {what}")
            if status >= 500 or code in _THROTTLE_CODES:
                return StorageUnavailable(f"S3 at {where} is unavailable while {what} ({code or status})")
            return StorageError(f"S3 error {code or status} for {where} while {what}")
        if isinstance(exc, (bx.NoCredentialsError, bx.PartialCredentialsError)):
            return StorageAuthError(
                f"no usable AWS credentials for {where}: set AWS_PROFILE or AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY"
            )
        if isinstance(
            exc, (bx.ConnectionError, bx.HTTPClientError, bx.IncompleteReadError, ConnectionError, TimeoutError)
        ):
            return StorageUnavailable(
                f"cannot reach S3 endpoint {self.endpoint_url or 'AWS'} for {self.url} "
                f"while {what} ({type(exc).__name__}): check storage.endpoint_url and that "
                "the server is up"
            )
        return StorageError(f"S3 client error for {where} while {what} ({type(exc).__name__})")

    def _call(self, what: str, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        from botocore import exceptions as bx

        try:
            return fn(*args, **kwargs)
        except (bx.ClientError, bx.BotoCoreError) as exc:
            raise self._error(exc, what) from exc

    # -- small-object operations ------------------------------------------------------
    def list(self, prefix: str = "") -> dict[str, ObjectStat]:
        full = self._key(prefix) if prefix else (f"{self.prefix}/" if self.prefix else "")
        strip = len(self.prefix) + 1 if self.prefix else 0
        out: dict[str, ObjectStat] = {}
        pages = self._call(
            f"listing {full or '/'}",
            self.client.get_paginator("list_objects_v2").paginate,
            Bucket=self.bucket,
            Prefix=full,
        )
        from botocore import exceptions as bx

        try:
            for page in pages:
                for obj in page.get("Contents", ()):
                    etag = str(obj.get("ETag", "")).strip('"')
                    out[obj["Key"][strip:]] = ObjectStat(int(obj["Size"]), obj["LastModified"].timestamp(), etag)
        except (bx.ClientError, bx.BotoCoreError) as exc:
            raise self._error(exc, f"listing {full or '/'}") from exc
        return out

    def folders(self) -> builtins.list[str]:
        """The names of the folders at the store's root (one delimited LIST: no object of theirs
        is listed, which a store that hashes on listing, rclone serve s3, would read whole)."""
        full = f"{self.prefix}/" if self.prefix else ""
        pages = self._call(
            f"listing {full or '/'}",
            self.client.get_paginator("list_objects_v2").paginate,
            Bucket=self.bucket,
            Prefix=full,
            Delimiter="/",
        )
        from botocore import exceptions as bx

        try:
            return [cp["Prefix"][len(full) :].rstrip("/") for page in pages for cp in page.get("CommonPrefixes", ())]
        except (bx.ClientError, bx.BotoCoreError) as exc:
            raise self._error(exc, f"listing {full or '/'}") from exc

    def read_bytes(self, key: str) -> bytes | None:
        from botocore import exceptions as bx

        try:
            resp = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
            body: bytes = resp["Body"].read()
            return body
        except bx.ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound"):
                return None
            raise self._error(exc, f"reading {key}") from exc
        except bx.BotoCoreError as exc:
            raise self._error(exc, f"reading {key}") from exc

    def write_bytes(self, key: str, data: bytes) -> None:
        import base64
        import hashlib

        sha = base64.b64encode(hashlib.sha256(data).digest()).decode()  # the payload is not signed
        answers = s3parts.Answers(self.keeps_checksums)
        answers.saw(
            self._call(
                f"writing {key}",
                self.client.put_object,
                Bucket=self.bucket,
                Key=self._key(key),
                Body=data,
                ChecksumAlgorithm="SHA256",
                ChecksumSHA256=sha,
            )
        )
        self.keeps_checksums = answers.kept

    def head_sha256(self, key: str) -> str | None:
        from botocore import exceptions as bx

        try:
            resp = self.client.head_object(Bucket=self.bucket, Key=self._key(key))
        except bx.ClientError as exc:
            if exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 404:
                return None
            raise self._error(exc, f"checking {key}") from exc
        except bx.BotoCoreError as exc:
            raise self._error(exc, f"checking {key}") from exc
        sha: str | None = resp.get("Metadata", {}).get("sha256")
        return sha

    def part_size(self, size: int) -> int | None:
        """The part size for a file of ``size`` bytes (None: one PUT); within S3's limits
        (5 MiB..5 GiB, at most 10,000 parts), as boto3's transfer manager sizes them."""
        if size < self.options.multipart_threshold:
            return None
        from s3transfer.utils import ChunksizeAdjuster

        part: int = ChunksizeAdjuster().adjust_chunksize(self.options.multipart_chunksize, size)
        return part

    def content_matches(
        self, key: str, size: int, sha256: str, composite: str | None, *, read_back: bool = True
    ) -> bool:
        """The stored object holds these bytes: S3's own SHA256 checksum (verified by S3 when it
        received the upload, ChecksumAlgorithm=SHA256) equals the local file's sha256, or for a
        multipart upload its composite of part digests. An object without a checksum (some
        S3-compatible servers, objects written by other tools) is read back and hashed; with
        read_back=False (deciding whether to upload again) its x-amz-meta-sha256 is taken instead."""
        import base64

        from botocore import exceptions as bx

        try:
            resp = self.client.head_object(Bucket=self.bucket, Key=self._key(key), ChecksumMode="ENABLED")
        except bx.ClientError as exc:
            if exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 404:
                return False
            raise self._error(exc, f"checking {key}") from exc
        except bx.BotoCoreError as exc:
            raise self._error(exc, f"checking {key}") from exc
        if int(resp.get("ContentLength", -1)) != size:
            return False
        stored = str(resp.get("ChecksumSHA256") or "").split("-")[0]  # AWS: "<b64>-<parts>" when composite
        if stored:
            return stored in (base64.b64encode(bytes.fromhex(sha256)).decode(), composite)
        if not read_back:
            return bool(resp.get("Metadata", {}).get("sha256") == sha256)
        return self._read_back_sha256(key) == sha256

    def _read_back_sha256(self, key: str) -> str:
        from botocore import exceptions as bx

        try:
            return s3parts.read_back_sha256(self.client, self.bucket, self._key(key))
        except (bx.ClientError, bx.BotoCoreError) as exc:
            raise self._error(exc, f"reading {key} back") from exc

    def delete(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        for i in range(0, len(keys), 1000):
            batch = [{"Key": self._key(k)} for k in keys[i : i + 1000]]
            resp = self._call(
                "deleting objects",
                self.client.delete_objects,
                Bucket=self.bucket,
                Delete={"Objects": batch, "Quiet": True},
            )
            if resp.get("Errors"):
                first = resp["Errors"][0]
                raise StorageError(
                    f"could not delete {len(resp['Errors'])} objects under "
                    f"{self.url} (first: {first.get('Key')}: {first.get('Code')})"
                )

    def delete_prefix(self, prefix: str) -> None:
        self.delete(self.list(prefix.rstrip("/") + "/"))  # keys come back relative to the root

    # -- bulk transfers (s3parts.py: one buffer per request, hashed once) ---------------
    def _transfer(self, what: str, fn: Callable[[], _T]) -> _T:
        from botocore import exceptions as bx

        try:
            return fn()
        except (bx.ClientError, bx.BotoCoreError) as exc:
            raise self._error(exc, what) from exc

    def upload_files(self, items: builtins.list[UploadItem], progress: Progress) -> dict[str, Uploaded]:
        """Upload; each key's digests (hashed as sent). Learns whether the store keeps SHA256
        checksums (``keeps_checksums``)."""
        if not items:
            return {}
        client, o, answers = self.client, self.options, s3parts.Answers(self.keeps_checksums)
        try:
            return self._transfer(
                f"uploading {len(items)} files",
                lambda: s3parts.upload(
                    client,
                    self.bucket,
                    self._key,
                    items,
                    self.part_size,
                    o.max_concurrency,
                    o.max_buffer,
                    progress,
                    answers,
                ),
            )
        finally:
            self.keeps_checksums = answers.kept

    def download_files(self, items: builtins.list[DownloadItem], progress: Progress) -> dict[str, str]:
        """Download each item to its dest; each key's sha256 of the bytes written (hashed in flight)."""
        if not items:
            return {}
        client, o = self.client, self.options
        return self._transfer(
            f"downloading {len(items)} files",
            lambda: s3download.download(
                client, self.bucket, self._key, items, self.part_size, o.max_concurrency, progress
            ),
        )
