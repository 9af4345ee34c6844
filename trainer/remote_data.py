"""Training data from s3:// (any S3-compatible store): local rank 0 of each node downloads the
object into <run dir>/cache/remote/ and the tokenize-once path in trainer.dataset takes it.

Endpoint and region come from run.json["storage"] (the same store as the checkpoints, so R2 /
MinIO work); credentials from the AWS_* env the rank loads from secrets.env (secrets_file.py). boto3 is
imported only when s3:// data is used. Errors are one line and never show credentials.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from urllib.parse import urlparse

from trainer.config import TrainerError

DATA_SUFFIXES = (".txt", ".jsonl", ".parquet")


def is_remote(data: str) -> bool:
    return "://" in data


def parse_s3_url(data: str) -> tuple[str, str]:
    """s3://bucket/key -> (bucket, key); one clear TrainerError for anything else."""
    parsed = urlparse(data)
    if parsed.scheme != "s3":
        raise TrainerError(
            f"train.data {data!r}: only s3:// remote data is supported; ship a local file or use s3://bucket/key"
        )
    key = parsed.path.lstrip("/")
    if not parsed.netloc or not key or key.endswith("/"):
        raise TrainerError(f"train.data {data!r}: expected s3://bucket/path/to/file(.txt|.jsonl|.parquet)")
    if PurePosixPath(key).suffix not in DATA_SUFFIXES:
        raise TrainerError(f"train.data {data!r}: expected a .txt, .jsonl or .parquet object")
    return parsed.netloc, key


def local_copy(data: str, cache_dir: Path) -> Path:
    """Where the object lands: the same path on every rank of a node (no S3 call needed)."""
    bucket, key = parse_s3_url(data)
    digest = hashlib.sha256(f"{bucket}/{key}".encode()).hexdigest()[:12]
    return cache_dir / "remote" / digest / PurePosixPath(key).name


def _client(storage: dict | None):
    try:
        import boto3
        from botocore.config import Config
    except ImportError:
        raise TrainerError("s3:// train.data needs boto3 on the node (pip install boto3)") from None
    storage = storage or {}
    config = Config(
        region_name=storage.get("region") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1",
        retries={"max_attempts": 4, "mode": "standard"},
        connect_timeout=5,
        read_timeout=60,
    )
    # profile stays None: credentials arrive as AWS_* env (docs/CONTRACTS.md)
    return boto3.session.Session().client("s3", endpoint_url=storage.get("endpoint_url") or None, config=config)


def _explain(exc: Exception, data: str, endpoint: str | None) -> TrainerError:
    from botocore import exceptions as bx

    where = f"{data}" + (f" (endpoint {endpoint})" if endpoint else "")
    if isinstance(exc, bx.NoCredentialsError):
        return TrainerError(
            f"train.data {where}: no S3 credentials on the node (gpuctl ships AWS_* only "
            "when storage.url is s3://; use an s3:// storage.url on the same store)",
            everywhere=False,
        )
    if isinstance(exc, bx.ClientError):
        code = str(exc.response.get("Error", {}).get("Code", ""))
        if code in ("404", "NoSuchKey", "NotFound", "NoSuchBucket"):
            return TrainerError(f"train.data {where}: no such object", everywhere=False)
        if code in ("403", "AccessDenied", "Forbidden", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            return TrainerError(
                f"train.data {where}: access denied ({code}); check the storage credentials", everywhere=False
            )
        return TrainerError(f"train.data {where}: S3 error {code}", everywhere=False)
    if isinstance(exc, (bx.EndpointConnectionError, bx.ConnectTimeoutError, bx.ReadTimeoutError)):
        return TrainerError(
            f"train.data {where}: cannot reach the S3 endpoint ({type(exc).__name__})", everywhere=False
        )
    return TrainerError(f"train.data {where}: download failed ({type(exc).__name__})", everywhere=False)


def download(data: str, storage: dict | None, cache_dir: Path, log: Callable[[str], None]) -> Path:
    """Fetch s3://bucket/key into the cache (atomic: tmp + rename); skip it when the cached copy
    has the object's ETag and size. Returns the local path."""
    from botocore import exceptions as bx

    bucket, key = parse_s3_url(data)
    out = local_copy(data, cache_dir)
    stamp = out.with_name(out.name + ".etag")
    endpoint = (storage or {}).get("endpoint_url")
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    try:
        client = _client(storage)
        head = client.head_object(Bucket=bucket, Key=key)
        etag, size = str(head.get("ETag", "")), int(head["ContentLength"])
        if out.is_file() and out.stat().st_size == size and stamp.is_file() and stamp.read_text() == etag:
            log(f"data: {data} already downloaded ({out})")
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
        progress = _Progress(size, log)
        log(f"data: downloading {data} ({size / 1e6:.1f} MB) -> {out}")
        client.download_file(bucket, key, str(tmp), Callback=progress)
    except (bx.BotoCoreError, bx.ClientError) as exc:
        tmp.unlink(missing_ok=True)
        raise _explain(exc, data, endpoint) from None
    os.replace(tmp, out)
    stamp.write_text(etag)
    log(f"data: downloaded {size / 1e6:.1f} MB in {time.monotonic() - progress.started:.1f}s")
    return out


class _Progress:
    """boto3's transfer callback (called from its threads with byte counts): a line every 10 s."""

    def __init__(self, total: int, log: Callable[[str], None]):
        self.total, self.done, self.log = total, 0, log
        self.lock = threading.Lock()
        self.started = time.monotonic()
        self.next_report = self.started + 10.0

    def __call__(self, nbytes: int) -> None:
        with self.lock:
            self.done += nbytes
            now = time.monotonic()
            if now < self.next_report:
                return
            self.next_report = now + 10.0
            pct = 100.0 * self.done / self.total if self.total else 100.0
            self.log(f"data: {self.done / 1e6:.1f}/{self.total / 1e6:.1f} MB ({pct:.0f}%, {now - self.started:.0f}s)")
