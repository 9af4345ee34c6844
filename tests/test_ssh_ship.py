"""SSHNode.ship_and_start (transport/ssh/ship.py): the bundle and the detached start in one exec
channel, against a real sshd on loopback. Fast: no DeepSpeed ranks."""

from __future__ import annotations

import os
import time
from contextlib import ExitStack
from pathlib import Path

import paramiko
import pytest

from provision.transport.ssh.node import SSHNode
from tests.sshd import SSHD

pytestmark = pytest.mark.timeout(120)


def node_for(server: SSHD) -> SSHNode:
    return SSHNode("127.0.0.1", server.port, server.user, str(server.client_key), pin_new=True)


def bundle(src: Path) -> Path:
    (src / "lib" / "pkg" / "__pycache__").mkdir(parents=True)
    (src / ".gitignore").write_text("__pycache__/\n*.tmp\n")
    (src / "lib" / "pkg" / "mod é.py").write_text("x = 1\n")
    (src / "lib" / "pkg" / "__pycache__" / "mod.pyc").write_text("c")
    (src / "skip.tmp").write_text("t")
    (src / "run.json").symlink_to("lib/pkg/mod é.py")
    secrets = src / "secrets.env"
    secrets.write_text("TOKEN='s3cr3t'\n")
    secrets.chmod(0o600)
    (src / "launch.sh").write_text("echo started $(cat secrets.env); sleep 30\n")
    (src / "launch.sh").chmod(0o755)
    return src


def wait_for(check, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "not reached in time"
        time.sleep(0.05)


def test_ship_and_start_is_one_exec_channel(sshd, tmp_path, monkeypatch):
    node = node_for(sshd)
    node.connection()  # connected before counting: what train's warm-up does
    opened: list[str] = []
    real_open = paramiko.Transport.open_session

    def counting(self, *args, **kw):
        opened.append("session")
        return real_open(self, *args, **kw)

    monkeypatch.setattr(paramiko.Transport, "open_session", counting)
    run_dir = tmp_path / "node" / "runs" / "r 1; $(touch pwned)"
    pgid = node.ship_and_start(bundle(tmp_path / "b"), str(run_dir), "launch.sh", "job.log", ExitStack())
    assert opened == ["session"]  # no SFTP session, no second channel for the start
    monkeypatch.setattr(paramiko.Transport, "open_session", real_open)
    try:
        assert os.getpgid(pgid) == pgid and os.getsid(pgid) == pgid  # detached: its own session and group
        wait_for(lambda: (run_dir / "job.log").is_file() and "started" in (run_dir / "job.log").read_text())
        assert (run_dir / "job.log").read_text() == "started TOKEN='s3cr3t'\n"
        shipped = {str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if not p.is_dir()}
        assert shipped == {"lib/pkg/mod é.py", "run.json", "secrets.env", "launch.sh", ".gitignore", "job.log"}
        assert (run_dir / "secrets.env").stat().st_mode & 0o777 == 0o600
        assert os.access(run_dir / "launch.sh", os.X_OK)
        assert os.readlink(run_dir / "run.json") == "lib/pkg/mod é.py"
        for folder in (run_dir, run_dir / "lib", run_dir / "lib" / "pkg"):
            assert folder.stat().st_mode & 0o777 == 0o700
        assert not (Path.home() / "pwned").exists()
    finally:
        node.signal_group(pgid, "KILL")
    wait_for(lambda: not node.group_alive(pgid))


def test_ship_and_start_without_tar_falls_back_to_sftp(sshd, tmp_path, monkeypatch):
    from provision.transport.ssh import ship

    node = node_for(sshd)
    monkeypatch.setattr(ship, "SHIP_SCRIPT", f"exit {ship.NO_TAR}")  # the node's answer when it has no tar
    run_dir = tmp_path / "run"
    pgid = node.ship_and_start(bundle(tmp_path / "b"), str(run_dir), "launch.sh", "job.log", ExitStack())
    try:
        wait_for(lambda: (run_dir / "job.log").is_file() and "started" in (run_dir / "job.log").read_text())
        assert (run_dir / "secrets.env").stat().st_mode & 0o777 == 0o600
    finally:
        node.signal_group(pgid, "KILL")


def test_a_failed_unpack_is_one_line(sshd, tmp_path):
    node = node_for(sshd)
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(Exception, match="unpacking the bundle failed") as got:
        node.ship_and_start(bundle(tmp_path / "b"), str(blocker / "run"), "launch.sh", "job.log", ExitStack())
    assert "\n" not in str(got.value).strip()
    assert node.run(["true"]).rc == 0  # the connection is still good
