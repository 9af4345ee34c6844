"""A real image registry for tests: Debian's docker-registry (the CNCF distribution registry) on
loopback, with htpasswd (bcrypt) basic auth, file storage under the test's folder.

Docker engines treat 127.0.0.0/8 registries as insecure (plain HTTP) by default, so the engines of
tests/dockerd.py push to and pull from it as they would from ghcr.io. ``Registry(root, user,
password).start()``; ``.host`` is ``127.0.0.1:PORT``; ``stop()``.
"""

from __future__ import annotations

import shutil
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.helpers import free_port

REGISTRY_BIN = shutil.which("docker-registry") or "/usr/bin/docker-registry"


class Registry:
    def __init__(self, root: Path, user: str, password: str):
        if not Path(REGISTRY_BIN).exists():
            pytest.skip("no image registry here (apt-get install docker-registry)")
        import bcrypt

        self.root, self.port = root, free_port()
        self.host = f"127.0.0.1:{self.port}"
        self.log = root / "registry.log"
        self.proc: subprocess.Popen | None = None
        hashed = bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=4)).decode()
        (root / "htpasswd").write_text(f"{user}:{hashed}\n")
        (root / "config.yml").write_text(
            "version: 0.1\n"
            "log: {level: warn}\n"
            f"storage: {{filesystem: {{rootdirectory: {root / 'data'}}}}}\n"
            f"http: {{addr: '{self.host}'}}\n"
            f"auth: {{htpasswd: {{realm: gpuctl-test, path: {root / 'htpasswd'}}}}}\n"
        )

    def start(self, timeout: float = 20) -> Registry:
        with open(self.log, "ab") as log:
            argv = [REGISTRY_BIN, "serve", str(self.root / "config.yml")]
            self.proc = subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"docker-registry exited {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                urllib.request.urlopen(f"http://{self.host}/v2/", timeout=2)
            except urllib.error.HTTPError as exc:
                if exc.code == 401:  # up, and asking for the credential
                    return self
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"docker-registry did not answer within {timeout}s: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
