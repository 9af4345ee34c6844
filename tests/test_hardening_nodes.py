"""Nodes and clusters: one `up` at a time (two real processes race), `down` ends paid nodes when a
run will not stop, authorized_keys edits that cannot lock the user out and a cluster key that
works only from the cluster, and host keys checked against ~/.ssh/known_hosts on first contact
with their fingerprint shown. Real sshd on loopback, the fake Vast.ai API for the paid nodes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from provision.core import state
from provision.core.config import load_config
from provision.core.errors import RemoteError
from provision.flows import cluster, job
from provision.providers import cloud
from provision.providers.base import UpOptions
from provision.providers.ssh_hosts import BACKEND as SSH_BACKEND
from provision.transport.remote import LocalNode
from provision.transport.ssh import mesh
from provision.transport.ssh.connect import HostKeyRefused
from provision.transport.ssh.node import SSHNode
from tests.fakes.harness import node_fields, saved_run, ssh_target, write_config
from tests.fakes.vast_api import FakeVast
from tests.helpers import GPUCTL
from tests.sshd import keygen

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def vast(sshd, monkeypatch):
    with FakeVast(ssh=ssh_target(sshd)) as server:
        monkeypatch.setenv("VAST_API_KEY", server.key)
        monkeypatch.setattr(cloud, "POLL_S", 0.2)
        yield server


def ssh_cfg(project: Path, sshd, hosts: list[str]) -> Path:
    prov = {
        "kind": "ssh",
        "hosts": hosts,
        "identity_file": str(sshd.client_key),
        "python": sys.executable,
        "cpu_ranks": 1,
        "workdir": str(project / "node"),
        "authorized_keys": str(sshd.authorized_keys),
        "ready_timeout": 20,
        "connect_timeout": 5,
    }
    path = project / "gpuctl.yaml"
    path.write_text(yaml.safe_dump({"name": "hard", "provider": prov, "train": {"max_steps": 2}}))
    return path


# --- 4: concurrent up ------------------------------------------------------------------------


def test_two_ups_at_once_create_one_cluster(project, vast, tmp_path, state_dir):
    vast.boot_polls = 4  # a few seconds of booting: the second `up` arrives while the first waits
    write_config(project, {"kind": "vast", "api_url": vast.url, **node_fields(tmp_path)}, name="race")
    procs = [
        subprocess.Popen(
            [*GPUCTL, "up", "--yes"], cwd=project, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    results = [(p.wait(timeout=100), p.stderr.read()) for p in procs]
    for p in procs:
        p.stdout.close()
        p.stderr.close()
    codes = sorted(rc for rc, _ in results)
    assert codes == [0, 7], results
    refused = next(err for rc, err in results if rc == 7)
    lines = [x for x in refused.splitlines() if x.startswith("error: ")]
    assert len(lines) == 1 and "another gpuctl is running `up` or `down` of cluster race" in lines[0]
    assert len(vast.instances) == 1  # no orphan: the refused `up` rented nothing
    record = state.load_cluster("race")
    assert [n.instance_id for n in record.nodes] == [str(i) for i in vast.instances]
    assert cluster.down("race", say=lambda _: None)
    assert not vast.instances


# --- 5: down when a run will not stop -------------------------------------------------------------


def test_down_terminates_paid_nodes_although_the_run_does_not_stop(project, vast, tmp_path, monkeypatch):
    write_config(project, {"kind": "vast", "api_url": vast.url, **node_fields(tmp_path)}, name="stuck")
    record = cluster.up(load_config(project / "gpuctl.yaml"), UpOptions(assume_yes=True, say=lambda _: None))
    stuck = subprocess.Popen(["setsid", "sleep", "600"])  # the run's process group on the "node"
    try:
        saved_run(record.name, "20260101-000000-stck", pgid=stuck.pid, run_dir=str(tmp_path / "node" / "runs" / "x"))
        # a node whose kill does not take (ranks stuck in the kernel on a dying GPU): signals are lost
        monkeypatch.setattr(SSHNode, "signal_group", lambda self, pgid, sig="TERM": None)
        monkeypatch.setattr(job, "KILL_REAP_S", 0.5)  # the reap wait after a KILL that never lands: 10 s idle
        said: list[str] = []
        started = time.monotonic()
        assert cluster.down(record.name, say=said.append, grace_s=1)
        assert time.monotonic() - started < 60
        assert not vast.instances and vast.deleted == [int(record.nodes[0].instance_id)]
        assert any("did not stop within 1s of TERM and KILL; terminating its vast node(s) ends it" in s for s in said)
        assert state.load_run("20260101-000000-stck").state == "lost"
        assert state.find_cluster(record.name) is None
    finally:
        os.kill(stuck.pid, signal.SIGKILL)
        stuck.wait(timeout=10)


def test_down_still_refuses_to_walk_away_from_a_live_run_on_your_own_machine(project, state_dir, monkeypatch):
    (project / "gpuctl.yaml").write_text("storage:\n  url: ./store\n")
    cfg = load_config(project / "gpuctl.yaml")
    cluster.up(cfg, UpOptions(say=lambda _: None))
    stuck = subprocess.Popen(["setsid", "sleep", "600"])
    try:
        saved_run(cfg.cluster_name, "20260101-000000-loca", pgid=stuck.pid)
        monkeypatch.setattr(LocalNode, "signal_group", lambda self, pgid, sig="TERM": None)
        monkeypatch.setattr(job, "KILL_REAP_S", 0.5)  # the reap wait after a KILL that never lands: 10 s idle
        with pytest.raises(Exception, match="did not stop"):
            cluster.down(cfg.cluster_name, say=lambda _: None, grace_s=0.5)
        assert state.find_cluster(cfg.cluster_name) is not None
    finally:
        os.kill(stuck.pid, signal.SIGKILL)
        stuck.wait(timeout=10)


# --- 7: authorized_keys ------------------------------------------------------------------------


def test_the_cluster_key_works_only_from_the_cluster_and_down_restores_the_file(sshd, project, state_dir):
    before = sshd.authorized_keys.read_text()
    ssh_cfg(project, sshd, [sshd.host("127.0.0.1"), sshd.host("127.0.0.2")])
    record = cluster.up(load_config(project / "gpuctl.yaml"), UpOptions(say=lambda _: None))
    ours = [x for x in sshd.authorized_keys.read_text().splitlines() if "gpuctl-mesh-hard" in x]
    assert len(ours) == 1 and ours[0].startswith('from="127.0.0.1')
    assert sshd.authorized_keys.read_text().startswith(before)
    folder = mesh.node_ssh_dir(record.nodes[0].workdir)
    first = SSH_BACKEND.nodes(record)[0]
    assert first.run(["ssh", "-F", f"{folder}/config", "127.0.0.2", "echo", "hop"]).stdout == "hop\n"  # as pdsh
    key = str(mesh.key_dir("hard") / "id_ed25519")
    base = ["ssh", "-i", key, "-o", "IdentitiesOnly=yes", "-o", "StrictHostKeyChecking=no", "-o", "BatchMode=yes"]
    base += ["-o", "UserKnownHostsFile=/dev/null", "-p", str(sshd.port)]
    elsewhere = subprocess.run([*base, "-b", "127.0.0.9", f"{sshd.user}@127.0.0.2", "true"], capture_output=True)
    assert elsewhere.returncode == 255  # the same key from an address outside the cluster: refused
    cluster.down("hard", say=lambda _: None)
    assert sshd.authorized_keys.read_text() == before


class FullDisk(LocalNode):
    """This machine, with every file write failing (RLIMIT_FSIZE 0: what a full disk does to a write)."""

    def _execute(self, argv, timeout, stream, stdin):
        if argv[:2] == ["bash", "-c"]:
            argv = ["bash", "-c", "ulimit -f 0; " + argv[2], *argv[3:]]
        return super()._execute(argv, timeout, stream, stdin)


def test_removing_the_cluster_key_on_a_full_disk_keeps_the_users_keys(tmp_path, state_dir):
    keys = tmp_path / "home" / ".ssh" / "authorized_keys"
    keys.parent.mkdir(parents=True)
    _private, public = mesh.cluster_keypair("full")
    user_key = Path(f"{keygen(tmp_path / 'user')}.pub").read_text().strip()
    keys.write_text(f"{user_key}\n{public}\n")
    (mesh.key_dir("full") / "authorized_keys").write_text(f"{keys}\n")
    record = state.ClusterRecord(
        name="full", provider="ssh", nodes=[state.NodeRecord(host="n0", workdir=str(tmp_path))]
    )
    said: list[str] = []
    mesh.teardown(record, [FullDisk()], say=said.append)
    assert keys.read_text() == f"{user_key}\n{public}\n"  # nothing lost: the user can still log in
    assert any("could not remove the cluster key" in s for s in said)
    assert [p.name for p in keys.parent.iterdir()] == ["authorized_keys"]  # no temp file left
    # with room on the disk: only our line goes, whatever options it carries
    _private, public = mesh.cluster_keypair("full")  # (teardown forgot the first one)
    (mesh.key_dir("full") / "authorized_keys").write_text(f"{keys}\n")
    keys.write_text(f'{user_key}\nfrom="10.0.0.1" {public}\n')
    mesh.teardown(record, [LocalNode()], say=said.append)
    assert keys.read_text() == f"{user_key}\n"


def test_clusters_editing_one_authorized_keys_at_once_keep_every_line(tmp_path):
    """Eight setups on one host at once (eight clusters, or a setup beside a teardown): each line
    stays, none is lost to another's rename, and a refused edit says why."""
    keys = tmp_path / "authorized_keys"
    keys.write_text("ssh-ed25519 AAAAuser user\n")
    lines = [f"ssh-ed25519 AAAAmesh{i} gpuctl-mesh-c{i}" for i in range(8)]
    edits = [
        subprocess.Popen(["bash", "-c", mesh.EDIT_KEY, "x", str(keys), x, x], stderr=subprocess.DEVNULL) for x in lines
    ]
    assert [e.wait(timeout=60) for e in edits] == [0] * 8
    assert sorted(keys.read_text().splitlines()) == sorted(["ssh-ed25519 AAAAuser user", *lines])
    bad = subprocess.run(["bash", "-c", mesh.EDIT_KEY, "x", str(keys), "no-key", "x"], capture_output=True, text=True)
    assert bad.returncode == 1 and bad.stderr.strip() == f"authorized_keys {keys}: no key in the line to edit"


# --- 10: host keys ------------------------------------------------------------------------------


def fingerprint(pub: Path) -> str:
    out = subprocess.run(["ssh-keygen", "-lf", str(pub)], capture_output=True, text=True, check=True).stdout
    return out.split()[1]  # "256 SHA256:... comment (ED25519)"


def test_first_contact_prints_the_fingerprint_it_pins(sshd, project, state_dir, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.ssh/known_hosts
    ssh_cfg(project, sshd, [sshd.host("127.0.0.1")])
    cluster.up(load_config(project / "gpuctl.yaml"), UpOptions(say=lambda _: None))
    err = capsys.readouterr().err
    assert f"[127.0.0.1]:{sshd.port}: pinned host key ssh-ed25519 {fingerprint(Path(f'{sshd.host_key}.pub'))}" in err
    cluster.down("hard", say=lambda _: None)


def test_a_host_in_known_hosts_must_present_that_key(sshd, project, state_dir, monkeypatch, tmp_path, capsys):
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    other = Path(f"{keygen(tmp_path / 'other-host')}.pub").read_text().split()
    (home / ".ssh" / "known_hosts").write_text(f"[127.0.0.1]:{sshd.port} {other[0]} {other[1]}\n")
    ssh_cfg(project, sshd, [sshd.host("127.0.0.1")])
    with pytest.raises(HostKeyRefused) as refused:
        cluster.up(load_config(project / "gpuctl.yaml"), UpOptions(say=lambda _: None))
    line = refused.value.one_line()
    assert "differs from the one your" in line and "known_hosts" in line and "ssh-keygen -R" in line
    assert not (state_dir / "known_hosts").exists() or str(sshd.port) not in (state_dir / "known_hosts").read_text()
    assert state.find_cluster("hard") is None
    # the right key, hashed as OpenSSH writes it by default (HashKnownHosts yes): accepted and said so
    real = Path(f"{sshd.host_key}.pub").read_text().split()
    (home / ".ssh" / "known_hosts").write_text(f"[127.0.0.1]:{sshd.port} {real[0]} {real[1]}\n")
    subprocess.run(["ssh-keygen", "-H", "-f", str(home / ".ssh" / "known_hosts")], capture_output=True, check=True)
    assert "127.0.0.1" not in (home / ".ssh" / "known_hosts").read_text()
    capsys.readouterr()
    cluster.up(load_config(project / "gpuctl.yaml"), UpOptions(say=lambda _: None))
    assert "(the key your ~/.ssh/known_hosts has for it)" in capsys.readouterr().err
    cluster.down("hard", say=lambda _: None)


def test_the_cli_says_the_mismatch_in_one_line(sshd, project, gpuctl, tmp_path):
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    other = Path(f"{keygen(tmp_path / 'other-host')}.pub").read_text().split()
    (home / ".ssh" / "known_hosts").write_text(f"[127.0.0.1]:{sshd.port} {other[0]} {other[1]}\n")
    ssh_cfg(project, sshd, [sshd.host("127.0.0.1")])
    result = gpuctl("up", env={"HOME": str(home)}, timeout=60)
    assert result.returncode == RemoteError.exit_code
    errors = [x for x in result.stderr.splitlines() if x.startswith("error: ")]
    assert len(errors) == 1 and "refusing to connect" in errors[0] and "Traceback" not in result.stderr
