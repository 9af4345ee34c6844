"""A real OpenSSH server on loopback for tests and benchmarks.

``SSHD`` runs ``/usr/sbin/sshd -f CFG -D -e`` (apt: openssh-server) with its own config:
Port (a free one), ListenAddress 127.0.0.1 and 127.0.0.2 (two "nodes" on one machine),
a host key generated per server, AuthorizedKeysFile = a test file, UsePAM no, StrictModes
no, PidFile, internal-sftp. Logins are as the current user (root here) with a test key.

``stop()`` kills the listener AND its session processes (what a crashed or restarted sshd
leaves: every connection drops); ``start()`` brings it back on the same port;
``new_host_key()`` makes the next start present a different key.

Fixtures (registered by tests/conftest.py's ``pytest_plugins``; ask for them by name):
``sshd`` is one server per test session; ``fresh_sshd`` one per test, for tests that stop or
re-key it.
"""

from __future__ import annotations

import getpass
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import free_port, parent_of

SSHD_BIN = shutil.which("sshd") or "/usr/sbin/sshd"
ADDRESSES = ("127.0.0.1", "127.0.0.2")


def keygen(path: Path, comment: str = "gpuctl-test") -> Path:
    path.unlink(missing_ok=True)
    Path(f"{path}.pub").unlink(missing_ok=True)
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)], check=True, timeout=30
    )
    return path


def children_of(pid: int) -> list[int]:
    """Every descendant of pid (walks /proc), deepest last."""
    parents: dict[int, list[int]] = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            parents.setdefault(parent_of(proc.name), []).append(int(proc.name))
        except OSError:
            continue
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


class SSHD:
    def __init__(self, root: Path, port: int | None = None, session_env: dict[str, str] | None = None):
        if not os.path.exists(SSHD_BIN):
            pytest.skip("sshd not installed (apt-get install openssh-server)")
        self.root = root
        self.port = port or free_port(*ADDRESSES[1:])
        self.user = getpass.getuser()
        self.host_key = root / "ssh_host_ed25519_key"
        self.client_key = keygen(root / "id_test")
        self.authorized_keys = root / "authorized_keys"
        self.authorized_keys.write_text(Path(f"{self.client_key}.pub").read_text())
        self.config = root / "sshd_config"
        self.log = root / "sshd.log"
        self.proc: subprocess.Popen | None = None
        # sshd takes only the first SetEnv line: every variable a session gets goes in that one
        self.session_env = {"SHLVL": "1", **(session_env or {})}
        keygen(self.host_key, "host")
        self._write_config()

    def _write_config(self) -> None:
        sftp = "/usr/lib/openssh/sftp-server"
        self.config.write_text(
            "\n".join(
                [
                    f"Port {self.port}",
                    *(f"ListenAddress {a}" for a in ADDRESSES),
                    f"HostKey {self.host_key}",
                    f"AuthorizedKeysFile {self.authorized_keys}",
                    f"PidFile {self.root / 'sshd.pid'}",
                    "UsePAM no",
                    "StrictModes no",
                    "PermitRootLogin prohibit-password",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    "PubkeyAuthentication yes",
                    "PrintMotd no",
                    "UseDNS no",
                    # pdsh and the tests open many sessions at once
                    "MaxStartups 200:30:400",
                    "MaxSessions 100",
                    f"Subsystem sftp {sftp if os.path.exists(sftp) else 'internal-sftp'}",
                    "LogLevel VERBOSE",
                    # Debian's bash sources ~/.bashrc for a command sent over ssh when SHLVL
                    # is below 2: the login user's own rc (pyenv, conda init...) would run in
                    # every test session, and a stale `pyenv rehash` lock there stalls each
                    # one for 60 s. The tests' sessions start from the server's environment only
                    # (SHLVL=1 in session_env).
                    "SetEnv " + " ".join(f"{k}={v}" for k, v in self.session_env.items()),
                    "",
                ]
            )
        )

    def start(self, timeout: float = 20) -> SSHD:
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)
        log = open(self.log, "ab")
        self.proc = subprocess.Popen(
            [SSHD_BIN, "-f", str(self.config), "-D", "-e"], stdout=log, stderr=log, stdin=subprocess.DEVNULL
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sshd exited {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            if all(self._banner(a) for a in ADDRESSES):
                return self
            time.sleep(0.05)
        raise RuntimeError(f"sshd did not answer within {timeout}s: {self.log.read_text()[-2000:]}")

    def _banner(self, address: str) -> bool:
        try:
            with socket.create_connection((address, self.port), timeout=1) as sock:
                sock.settimeout(2)
                return sock.recv(64).startswith(b"SSH-")
        except OSError:
            return False

    def stop(self) -> None:
        """Kill the listener and every session it spawned (all connections drop)."""
        if self.proc is None:
            return
        victims = [self.proc.pid, *children_of(self.proc.pid)]
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=10)
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def new_host_key(self) -> None:
        keygen(self.host_key, "host-rekeyed")

    def host(self, address: str = "127.0.0.1") -> str:
        return f"{self.user}@{address}:{self.port}"

    def ssh_argv(self, address: str = "127.0.0.1") -> list[str]:
        """The OpenSSH client command line for this server (test key, no known_hosts checks)."""
        return [
            "ssh",
            "-p",
            str(self.port),
            "-i",
            str(self.client_key),
            "-o",
            "IdentitiesOnly=yes",
            "-o",
            "StrictHostKeyChecking=no",
            "-o",
            "UserKnownHostsFile=/dev/null",
            "-o",
            "LogLevel=ERROR",
            "-o",
            "BatchMode=yes",
            f"{self.user}@{address}",
        ]


@pytest.fixture(scope="session")
def sshd(tmp_path_factory) -> SSHD:
    server = SSHD(tmp_path_factory.mktemp("sshd")).start()
    yield server
    server.stop()


@pytest.fixture
def fresh_sshd(tmp_path_factory) -> SSHD:
    server = SSHD(tmp_path_factory.mktemp("sshd1")).start()
    yield server
    server.stop()
