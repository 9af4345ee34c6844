"""A slow uplink between node and store: a real S3 server (moto) behind a bandwidth-capped TCP proxy.

``SlowLink`` shares one byte budget across all its connections (a node's uplink, not a per-connection
cap); ``slow_store(tmp_path, bytes_per_s)`` runs moto behind it and yields run.json's storage block.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.helpers import free_port
from tests.s3server import HOST, MotoS3, TcpProxy


class SlowLink(TcpProxy):
    """The proxy with one bandwidth cap for all its connections: a slow uplink between node and store."""

    def __init__(self, listen_port: int, target_port: int, bytes_per_s: float):
        super().__init__(listen_port, target_port)
        self.bytes_per_s = bytes_per_s
        self._link_lock = threading.Lock()
        self._free_at = time.monotonic()  # when the link has sent everything queued so far

    def before_send(self, nbytes: int) -> None:
        with self._link_lock:
            self._free_at = max(self._free_at, time.monotonic()) + nbytes / self.bytes_per_s
            wait = self._free_at - time.monotonic()
        if wait > 0:
            time.sleep(wait)


@contextmanager
def slow_store(log_dir: Path, bytes_per_s: float) -> Iterator[dict]:
    """An S3 bucket behind a link of bytes_per_s; yields the run.json storage block (needs s3 credentials
    in the environment: tests.s3server's TEST_KEY_ID / TEST_SECRET)."""
    with MotoS3(log_dir=log_dir) as server:
        bucket = server.make_bucket()
        link = SlowLink(free_port(), server.port, bytes_per_s=bytes_per_s)
        link.start()
        try:
            yield {
                "url": f"s3://{bucket}/runs/{uuid.uuid4().hex[:6]}",
                "endpoint_url": f"http://{HOST}:{link.listen_port}",
                "region": "us-east-1",
                "profile": None,
                "keep": 3,
            }
        finally:
            link.stop()
