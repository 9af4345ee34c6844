"""Nodes behind a bastion, for real: a network namespace only the bastion reaches.

``NodeNet`` makes a network namespace (``ip netns add``; only its loopback, up) and runs the
"private network" there: one OpenSSH server (tests/sshd.py's SSHD, launched with ``ip netns
exec``) listening on 127.0.55.1 and 127.0.55.2, two nodes that reach each other directly. No
route leads into the namespace, so this process (the laptop) cannot reach either node.

``Bastion`` is the jump host the laptop reaches: a listener on 127.0.0.1 (this namespace)
that hands each connection to ``sshd -i`` (OpenSSH in inetd mode) started inside the
namespace, so its TCP forwarding (ProxyJump's direct-tcpip) connects to the private addresses.
``forwarding=False`` makes one that refuses to forward; ``stop()`` closes the listener (a
refused connection); ``new_host_key()`` makes the next connection present another key.

``node_net`` (module scope) skips the module with the reason when namespaces are not permitted.
"""

from __future__ import annotations

import itertools
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.sshd import SSHD, SSHD_BIN, children_of, keygen

NODE_ADDRESSES = ("127.0.55.1", "127.0.55.2")
_names = itertools.count()


def _kill_tree(pid: int) -> None:
    for victim in [pid, *children_of(pid)]:
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass


class NetnsSSHD(SSHD):
    """SSHD inside a network namespace, listening on the private addresses only."""

    def __init__(self, root: Path, netns: str):
        self.netns = netns
        root.mkdir(parents=True, exist_ok=True)
        super().__init__(root)

    def _write_config(self) -> None:
        super()._write_config()
        lines = [ln for ln in self.config.read_text().splitlines() if not ln.startswith("ListenAddress ")]
        lines[1:1] = [f"ListenAddress {a}" for a in NODE_ADDRESSES]
        self.config.write_text("\n".join(lines) + "\n")

    def start(self, timeout: float = 20) -> NetnsSSHD:
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)
        self.log.write_text("")
        with open(self.log, "ab") as log:
            argv = ["ip", "netns", "exec", self.netns, SSHD_BIN, "-f", str(self.config), "-D", "-e"]
            self.proc = subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:  # no route in: the log says when it listens
            if self.proc.poll() is not None:
                raise RuntimeError(f"sshd exited {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            if self.log.read_text().count("Server listening on") >= len(NODE_ADDRESSES):
                return self
            time.sleep(0.05)
        raise RuntimeError(f"sshd in {self.netns} did not listen within {timeout}s: {self.log.read_text()[-2000:]}")

    def host(self, address: str = NODE_ADDRESSES[0]) -> str:
        return f"{self.user}@{address}:{self.port}"


class Bastion:
    def __init__(self, root: Path, netns: str, authorized_keys: Path, *, forwarding: bool = True):
        root.mkdir(parents=True, exist_ok=True)
        self.netns = netns
        self.host_key = keygen(root / "bastion_host_key", "bastion")
        self.config = root / "bastion_config"
        self.log = root / "bastion.log"
        self.config.write_text(
            "\n".join(
                [
                    f"HostKey {self.host_key}",
                    f"AuthorizedKeysFile {authorized_keys}",
                    "UsePAM no",
                    "StrictModes no",
                    "PermitRootLogin prohibit-password",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    "UseDNS no",
                    f"AllowTcpForwarding {'yes' if forwarding else 'no'}",
                    "LogLevel VERBOSE",
                    "SetEnv SHLVL=1",
                    "",
                ]
            )
        )
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.procs: list[subprocess.Popen] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _peer = self.listener.accept()
            except OSError:
                return  # closed by stop()
            with conn:
                argv = ["ip", "netns", "exec", self.netns, SSHD_BIN, "-i", "-f", str(self.config), "-E", str(self.log)]
                proc = subprocess.Popen(argv, stdin=conn.fileno(), stdout=conn.fileno(), stderr=subprocess.DEVNULL)
            self.procs.append(proc)

    def new_host_key(self) -> None:
        keygen(self.host_key, "bastion-rekeyed")

    def stop(self) -> None:
        try:  # wakes the accept() in _serve (a close() from another thread would not)
            self.listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.listener.close()
        self._thread.join(timeout=10)
        for proc in self.procs:
            if proc.poll() is None:
                _kill_tree(proc.pid)
                proc.wait(timeout=10)


class NodeNet:
    def __init__(self, root: Path):
        self.name = f"gpuctl-t{os.getpid()}-{next(_names)}"
        made = subprocess.run(["ip", "netns", "add", self.name], capture_output=True, text=True)
        if made.returncode != 0:
            pytest.skip(f"network namespaces are not permitted here (ip netns add: {made.stderr.strip()})")
        subprocess.run(["ip", "netns", "exec", self.name, "ip", "link", "set", "lo", "up"], check=True, timeout=30)
        self.root = root
        self.bastions: list[Bastion] = []
        try:
            self.sshd = NetnsSSHD(root / "node", self.name).start()
        except BaseException:
            self.close()
            raise

    def bastion(self, name: str = "bastion", *, forwarding: bool = True) -> Bastion:
        server = Bastion(self.root / name, self.name, self.sshd.authorized_keys, forwarding=forwarding)
        self.bastions.append(server)
        return server

    def close(self) -> None:
        for server in self.bastions:
            server.stop()
        if getattr(self, "sshd", None) is not None:
            self.sshd.stop()
        left = subprocess.run(["ip", "netns", "pids", self.name], capture_output=True, text=True).stdout.split()
        for pid in left:  # what the tests started in there (ranks of a failed run)
            _kill_tree(int(pid))
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def node_net(tmp_path_factory) -> NodeNet:
    net = NodeNet(tmp_path_factory.mktemp("netns"))
    yield net
    net.close()
