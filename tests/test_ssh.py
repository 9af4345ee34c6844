"""SSH transport and provider `ssh` against a real sshd on loopback (tests/sshd.py).

Fast: no DeepSpeed ranks. Every test is bounded by pytest-timeout and, where the point is
a bounded failure, by an explicit time assertion.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from provision.core import state
from provision.core.checks import ChecksFailed
from provision.core.config import load_config
from provision.core.errors import ConfigError, RemoteError
from provision.flows import cluster
from provision.providers.base import UpOptions
from provision.providers.ssh_hosts import BACKEND, Target, hostfile_names, stop_run_processes
from provision.transport.ignore import walk_shipped
from provision.transport.ssh import client_config as sshconfig
from provision.transport.ssh import mesh
from provision.transport.ssh.connect import ConnectError, wait_for_ssh
from provision.transport.ssh.hostkeys import known_hosts_path
from provision.transport.ssh.node import SSHNode, forget_host
from tests.sshd import SSHD

pytestmark = pytest.mark.timeout(120)


def node_for(server: SSHD, address: str = "127.0.0.1", pin: bool = True, **kw) -> SSHNode:
    return SSHNode(address, server.port, server.user, str(server.client_key), pin_new=pin, **kw)


def write_cfg(project: Path, server: SSHD, hosts: list[str] | None = None, **provider) -> Path:
    prov = {
        "kind": "ssh",
        "hosts": hosts or [server.host()],
        "identity_file": str(server.client_key),
        "python": sys.executable,
        "cpu_ranks": 1,
        "workdir": str(project / "node"),
        "authorized_keys": str(server.authorized_keys),
        "ready_timeout": 20,
        "connect_timeout": 5,
    }
    prov.update(provider)
    cfg = {"name": "sshtest", "provider": prov, "train": {"max_steps": 2}}
    path = project / "gpuctl.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def quiet(_line: str) -> None:
    pass


# --- transport -------------------------------------------------------------------------------


def test_run_streams_lines_stdin_and_exit_codes(sshd):
    node = node_for(sshd)
    seen: list[tuple[str, float]] = []
    result = node.run(
        ["bash", "-c", "for i in 1 2 3; do echo line$i; sleep 0.3; done; echo err >&2"],
        stream=lambda line: seen.append((line, time.monotonic())),
    )
    assert [s for s, _ in seen] == ["line1", "line2", "line3"]
    assert seen[-1][1] - seen[0][1] > 0.4  # streamed as they came, not all at the end
    assert result.stderr == "err\n"
    assert node.run(["cat"], stdin=b"from stdin\n").stdout == "from stdin\n"
    assert node.run(["bash", "-c", "exit 7"], check=False).rc == 7
    with pytest.raises(RemoteError, match="exited 7"):
        node.run(["bash", "-c", "echo boom >&2; exit 7"])
    start = time.monotonic()
    with pytest.raises(RemoteError, match="timed out"):
        node.run(["sleep", "30"], timeout=1)
    assert time.monotonic() - start < 5
    assert node.run(["true"]).rc == 0  # the connection is still good


def test_one_connection_per_host_per_process(sshd):
    a, b = node_for(sshd), node_for(sshd)
    assert a.client() is b.client()
    a.close()  # a healthy connection stays for the rest of the process
    assert b.client() is a.client()
    a.drop_connection()
    assert b.run(["true"]).rc == 0  # reconnects


def test_start_detached_survives_the_connection_closing(sshd, tmp_path):
    node = node_for(sshd)
    run_dir = tmp_path / "run; $(touch pwned) 'q'"
    node.run(["mkdir", "-p", str(run_dir)])
    node.write_text(f"{run_dir}/job.sh", "echo started; sleep 60\n", "755")
    start = time.monotonic()
    pgid = node.start_detached(str(run_dir), "job.sh", "job.log")
    assert time.monotonic() - start < 5  # returns at once; the channel does not wait for the job
    node.drop_connection()  # the SSH connection goes away
    other = node_for(sshd)
    assert other.group_alive(pgid)
    assert os.getpgid(pgid) == pgid and os.getsid(pgid) == pgid  # its own session and group
    assert other.read_text(f"{run_dir}/job.log") == "started\n"
    other.signal_group(pgid, "KILL")
    deadline = time.monotonic() + 10
    while other.group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not other.group_alive(pgid)
    assert not (Path.home() / "pwned").exists() and not (tmp_path / "pwned").exists()


NASTY = st.text(alphabet=st.sampled_from(list("ab ;$()`'\"\\\n\t|&*?~#!{}<>=%") + ["é", "-"]), min_size=1, max_size=12)


# No shrink phase: each example costs SSH round trips; the failing example is printed as found.
@settings(
    max_examples=30,
    deadline=None,
    phases=(Phase.explicit, Phase.reuse, Phase.generate),
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(args=st.lists(NASTY, min_size=1, max_size=4), name=NASTY, text=st.text(max_size=40))
def test_user_values_arrive_verbatim(sshd, tmp_path, args, name, text):
    node = node_for(sshd)
    out = node.run(["printf", "%s\\0", *args]).stdout
    assert out.split("\0")[:-1] == args
    base = tmp_path / "verbatim"
    safe = name.replace("/", "_")
    if safe in (".", ".."):
        safe = f"x{safe}"
    path = f"{base}/{safe}/f {safe}"
    node.write_text(path, text)
    assert Path(path).read_bytes() == text.encode()
    assert node.read_text(path) == text
    local = tmp_path / "src"
    (local / safe).mkdir(parents=True, exist_ok=True)
    (local / safe / safe).write_text(text)
    remote = f"{base}/put {safe}"
    node.put_dir(local, remote)
    assert Path(remote, safe, safe).read_bytes() == text.encode()
    assert not (Path.home() / "pwned").exists()


def test_put_dir_skips_ignored_files_and_keeps_modes(sshd, tmp_path):
    src = tmp_path / "bundle"
    (src / "build").mkdir(parents=True)
    (src / "lib" / "pkg" / "__pycache__").mkdir(parents=True)
    (src / "data").mkdir()
    (src / ".gitignore").write_text("# comment\n*.log\n!keep.log\nbuild/\n__pycache__/\n/top.tmp\n")
    (src / ".gpuctlignore").write_text("data/big*\n")
    (src / "lib" / ".gitignore").write_text("secret.txt\n")
    files = {
        "run.json": "{}",
        "a.log": "x",
        "keep.log": "k",
        "build/out.bin": "b",
        "top.tmp": "t",
        "lib/top.tmp": "kept: /top.tmp is anchored",
        "lib/pkg/mod.py": "m",
        "lib/pkg/__pycache__/m.pyc": "c",
        "lib/secret.txt": "s",
        "data/big.bin": "B",
        "data/small.txt": "s",
        "launch.sh": "#!/bin/sh\n",
    }
    for rel, body in files.items():
        (src / rel).write_text(body)
    (src / "launch.sh").chmod(0o755)
    (src / "link").symlink_to("run.json")
    shipped = {rel for rel, _, kind in walk_shipped(src) if kind != "dir"}
    assert shipped == {
        ".gitignore",
        ".gpuctlignore",
        "run.json",
        "keep.log",
        "lib/top.tmp",
        "lib/.gitignore",
        "lib/pkg/mod.py",
        "data/small.txt",
        "launch.sh",
        "link",
    }
    dest = tmp_path / "remote copy"
    node_for(sshd).put_dir(src, str(dest))
    got = {str(p.relative_to(dest)) for p in dest.rglob("*") if not p.is_dir()}
    assert got == shipped
    assert os.access(dest / "launch.sh", os.X_OK)
    assert (dest / "link").is_symlink() and os.readlink(dest / "link") == "run.json"
    assert (dest.stat().st_mode & 0o777) == 0o700


# --- host keys and connection failures -------------------------------------------------------


def test_host_key_pinned_on_first_contact_then_enforced(fresh_sshd, state_dir):
    server = fresh_sshd
    with pytest.raises(ConnectError, match="not pinned by gpuctl"):
        node_for(server, pin=False).run(["true"])
    assert node_for(server, pin=True).run(["true"]).rc == 0
    pinned = known_hosts_path().read_text()
    assert f"[127.0.0.1]:{server.port} ssh-ed25519 " in pinned
    node_for(server, pin=False).drop_connection()
    assert node_for(server, pin=False).run(["true"]).rc == 0  # pinned now

    server.stop()
    server.new_host_key()
    server.start()
    node_for(server).drop_connection()
    for pin in (False, True):  # even `up` (pin_new) refuses a CHANGED key
        start = time.monotonic()
        with pytest.raises(ConnectError) as err:
            node_for(server, pin=pin).run(["true"])
        assert time.monotonic() - start < 10
        line = err.value.one_line()
        assert "CHANGED" in line and f"127.0.0.1:{server.port}" in line
        assert f"gpuctl forget-host 127.0.0.1:{server.port}" in line
    assert known_hosts_path().read_text() == pinned  # nothing replaced

    assert forget_host(f"root@127.0.0.1:{server.port}") == 1
    assert node_for(server, pin=True).run(["true"]).rc == 0
    assert known_hosts_path().read_text() != pinned


def test_changed_host_key_refused_by_cli(fresh_sshd, project, gpuctl, state_dir):
    write_cfg(project, fresh_sshd)
    up = gpuctl("up", timeout=60)
    assert up.returncode == 0, up.stderr
    fresh_sshd.stop()
    fresh_sshd.new_host_key()
    fresh_sshd.start()
    status = gpuctl("ssh", "--", "true", timeout=60)
    assert status.returncode != 0  # OpenSSH with the generated config refuses too
    down = gpuctl("down", timeout=60)
    assert down.returncode == 0, down.stderr  # no run to stop: down needs no connection
    up = gpuctl("up", timeout=60)
    assert up.returncode != 0
    lines = up.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and "CHANGED" in lines[-1]
    assert f"gpuctl forget-host 127.0.0.1:{fresh_sshd.port}" in lines[-1]
    forget = gpuctl("forget-host", f"127.0.0.1:{fresh_sshd.port}", timeout=60)
    assert forget.returncode == 0 and "forgot 1" in forget.stderr
    up = gpuctl("up", timeout=60)
    assert up.returncode == 0, up.stderr


def _silent_listener() -> tuple[socket.socket, int]:
    """Accepts TCP connections and never says anything: a hung or firewalled host."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            held.append(conn)

    threading.Thread(target=accept, daemon=True).start()
    return sock, sock.getsockname()[1]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_connection_failures_are_one_line_within_a_bound(sshd, tmp_path):
    silent, silent_port = _silent_listener()
    wrong_key = tmp_path / "wrong_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(wrong_key)], check=True, timeout=30)
    cases = [
        (
            SSHNode("127.0.0.1", _closed_port(), "root", str(sshd.client_key), connect_timeout=3, pin_new=True),
            "connection refused",
            True,
        ),
        (
            SSHNode("127.0.0.1", silent_port, "root", str(sshd.client_key), connect_timeout=2, pin_new=True),
            "no SSH banner within 2s",
            True,
        ),
        (
            SSHNode("127.0.0.1", sshd.port, sshd.user, str(wrong_key), connect_timeout=3, pin_new=True),
            "authentication failed",
            False,
        ),
    ]
    try:
        for node, words, transient in cases:
            start = time.monotonic()
            with pytest.raises(ConnectError) as err:
                node.run(["true"])
            assert time.monotonic() - start < 8, words
            line = err.value.one_line()
            assert words in line and "\n" not in line and "(fix: " in line
            assert err.value.transient is transient
    finally:
        silent.close()


@pytest.mark.parametrize("problem", ["wrong port", "wrong key", "silent host"])
def test_gpuctl_up_failure_is_one_line_within_a_bound(sshd, project, gpuctl, state_dir, problem):
    silent, silent_port = _silent_listener()
    try:
        host = {
            "wrong port": f"{sshd.user}@127.0.0.1:{_closed_port()}",
            "silent host": f"{sshd.user}@127.0.0.1:{silent_port}",
        }.get(problem, sshd.host())
        extra = {}
        if problem == "wrong key":
            key = project / "other_key"
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True, timeout=30)
            extra["identity_file"] = str(key)
        write_cfg(project, sshd, hosts=[host], ready_timeout=4, connect_timeout=2, **extra)
        start = time.monotonic()
        up = gpuctl("up", timeout=60)
        elapsed = time.monotonic() - start
    finally:
        silent.close()
    assert up.returncode == 4
    last = up.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and host.split("@")[1] in last
    assert {"wrong port": "connection refused", "wrong key": "authentication failed", "silent host": "no SSH banner"}[
        problem
    ] in last
    # ready_timeout 4 s + one connect attempt (2 s) + interpreter start; auth failure is not retried
    assert elapsed < (5 if problem == "wrong key" else 12), elapsed
    assert not list(state_dir.glob("clusters/*.json"))


def test_up_waits_for_a_booting_node(tmp_path_factory, project, state_dir):
    server = SSHD(tmp_path_factory.mktemp("booting"))
    write_cfg(project, server, ready_timeout=30, connect_timeout=2)
    timer = threading.Timer(3.0, server.start)
    timer.start()
    said: list[str] = []
    try:
        record = cluster.up(load_config(project / "gpuctl.yaml"), UpOptions(say=said.append))
    finally:
        timer.join()
        server.stop()
    assert record is not None and record.nodes[0].slots == 1
    assert any("not ready" in line for line in said)


def test_wait_for_ssh_wants_a_banner(sshd):
    silent, port = _silent_listener()
    try:
        start = time.monotonic()
        with pytest.raises(ConnectError, match="no SSH server answered"):
            wait_for_ssh("127.0.0.1", port, time.monotonic() + 3, probe_timeout=1)
        assert time.monotonic() - start < 6
    finally:
        silent.close()
    assert wait_for_ssh("127.0.0.1", sshd.port, time.monotonic() + 5).startswith("SSH-2.0-")


# --- provider ssh ----------------------------------------------------------------------------


def test_up_records_the_cluster_and_writes_ssh_config(sshd, project, gpuctl, state_dir):
    write_cfg(project, sshd, cpu_ranks=2)
    up = gpuctl("up", timeout=60)
    assert up.returncode == 0, up.stderr
    record = state.load_cluster("sshtest")
    node = record.nodes[0]
    assert (node.address, node.port, node.user, node.slots, node.accelerator) == (
        "127.0.0.1",
        sshd.port,
        sshd.user,
        2,
        "cpu",
    )
    assert node.workdir == str(project / "node") and record.python == sys.executable
    assert record.identity_file == str(sshd.client_key)
    config = (state_dir / "ssh_config").read_text()
    assert "Host gpuctl-sshtest gpuctl-sshtest-0" in config and "StrictHostKeyChecking yes" in config
    assert f"Include {state_dir / 'ssh_config'}" in up.stderr
    # OpenSSH itself, with only the generated config, trusts the pinned key
    plain = subprocess.run(
        ["ssh", "-F", str(state_dir / "ssh_config"), "gpuctl-sshtest", "echo", "hi"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert plain.stdout == "hi\n", plain.stderr
    value = "a b; $(touch pwned) 'q' \"d\""
    via = gpuctl("ssh", "printf", "%s|", value, "x", timeout=30)
    assert via.returncode == 0 and via.stdout == f"{value}|x|", via.stderr
    shell = gpuctl("ssh", "echo one | tr o O; exit 3", timeout=30)
    assert shell.stdout == "One\n" and shell.returncode == 3
    down = gpuctl("down", timeout=60)
    assert down.returncode == 0, down.stderr
    assert "gpuctl-sshtest" not in (state_dir / "ssh_config").read_text()


def test_up_checks_the_node_python(sshd, project, state_dir):
    write_cfg(project, sshd, python="/usr/bin/python3-nope")
    with pytest.raises(ConfigError, match="not found on the node"):
        cluster.up(load_config(project / "gpuctl.yaml"), UpOptions(say=quiet))
    bare = project / "bare-python"
    bare.write_text(f'#!/bin/sh\nexec {sys.executable} -I -S "$@"\n')  # no site-packages: no torch
    bare.chmod(0o755)
    write_cfg(project, sshd, python=str(bare))
    with pytest.raises(ConfigError, match="lacks torch, deepspeed, transformers"):
        cluster.up(load_config(project / "gpuctl.yaml"), UpOptions(say=quiet))
    write_cfg(project, sshd, python=str(bare), setup="true")  # setup may install them: a warning path
    # ... which the quick node checks then close: after setup the python still has no torch
    with pytest.raises(ChecksFailed, match="failed 1 check"):
        cluster.up(load_config(project / "gpuctl.yaml"), UpOptions(say=quiet))
    cluster.down("sshtest", quiet)
    assert cluster.up(load_config(project / "gpuctl.yaml"), UpOptions(say=quiet, doctor=False)) is not None


def test_two_hosts_get_node_to_node_ssh_and_down_removes_it(sshd, project, state_dir):
    before = sshd.authorized_keys.read_text()
    write_cfg(project, sshd, hosts=[sshd.host("127.0.0.1"), sshd.host("127.0.0.2")])
    record = cluster.up(load_config(project / "gpuctl.yaml"), UpOptions(say=quiet))
    assert [n.host for n in record.nodes] == ["127.0.0.1", "127.0.0.2"]
    assert len({n.workdir for n in record.nodes}) == 1
    keys = sshd.authorized_keys.read_text()
    assert keys.startswith(before) and "gpuctl-mesh-sshtest" in keys and keys.count("gpuctl-mesh-sshtest") == 1
    folder = mesh.node_ssh_dir(record.nodes[0].workdir)
    assert (Path(folder) / "id_ed25519").stat().st_mode & 0o777 == 0o600
    # what pdsh does from the first node, with no ~/.ssh involvement
    hop = node_for(sshd).run(["ssh", "-F", f"{folder}/config", "127.0.0.2", "echo", "hop"])
    assert hop.stdout == "hop\n"
    known = (Path(folder) / "known_hosts").read_text()
    assert f"[127.0.0.2]:{sshd.port} ssh-ed25519" in known
    # up again is idempotent on authorized_keys
    mesh.setup(record, BACKEND.nodes(record), str(sshd.authorized_keys), say=quiet)
    assert sshd.authorized_keys.read_text().count("gpuctl-mesh-sshtest") == 1
    cluster.down("sshtest", say=quiet)
    assert sshd.authorized_keys.read_text() == before
    assert not Path(folder).exists()


def test_multinode_refuses_unsafe_paths(sshd, project, state_dir):
    write_cfg(project, sshd, hosts=[sshd.host("127.0.0.1"), sshd.host("127.0.0.2")], workdir=str(project / "node dir"))
    with pytest.raises(ConfigError, match="pastes it unquoted"):
        cluster.up(load_config(project / "gpuctl.yaml"), UpOptions(say=quiet))


def test_hostfile_names():
    t = [Target("root", "10.0.0.1", 22), Target("root", "10.0.0.2", 2222)]
    assert hostfile_names(t) == ["10.0.0.1", "10.0.0.2"]
    assert hostfile_names([t[0], Target("ubuntu", "10.0.0.3", 22)]) == ["10.0.0.1", "ubuntu@10.0.0.3"]
    assert hostfile_names([t[0], Target("root", "10.0.0.1", 2222)]) == ["node0", "node1"]


def test_down_stops_run_processes_by_cwd(sshd, tmp_path):
    node = node_for(sshd)
    run_dir, other = tmp_path / "runs" / "r1", tmp_path / "runs" / "r10"
    for folder in (run_dir, other):
        folder.mkdir(parents=True)
    # one ignoring TERM (needs the KILL), one in a sub folder, one in a look-alike folder (kept)
    procs = [
        subprocess.Popen(["bash", "-c", "trap '' TERM; sleep 60 & wait; sleep 60"], cwd=run_dir),
        subprocess.Popen(["sleep", "60"], cwd=run_dir),
        subprocess.Popen(["sleep", "60"], cwd=other),
    ]
    try:
        time.sleep(0.3)
        count = stop_run_processes([node], [str(run_dir)], quiet, grace_s=2)
        assert count >= 2
        for proc in procs[:2]:
            assert proc.wait(timeout=10) != 0
        assert procs[2].poll() is None
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_ssh_config_quotes_paths():
    block = sshconfig.host_block(["h"], "10.0.0.1", 22, "u", "/keys/a b%c", "/kh")
    assert 'IdentityFile "/keys/a b%%c"' in block
    with pytest.raises(ConfigError):
        sshconfig.quote('a"b')


def test_ssh_command_for_local_cluster_is_refused(project, state_dir):
    state.save_cluster(state.ClusterRecord(name="here", provider="local", nodes=[state.NodeRecord(host="localhost")]))
    with pytest.raises(ConfigError, match="no SSH"):
        sshconfig.ssh_argv("here", 0, [])


def test_sftp_fast_paths_match_the_shell_versions(sshd, tmp_path):
    from provision.transport.remote import Node

    node = node_for(sshd)
    log = tmp_path / "job.log"
    assert node.read_new(str(log), 0) == ("", 0) and node.last_line(str(log)) == ""
    data = "one\ntwo é\nthree".encode()
    log.write_bytes(data[:9])  # ends inside "é"
    text, offset = node.read_new(str(log), 0)
    assert text == "one\ntwo " and offset == 8  # waits for the rest of the character
    log.write_bytes(data)
    text, offset = node.read_new(str(log), offset)
    assert text == "é\nthree" and offset == len(data)
    assert node.read_new(str(log), offset) == ("", offset)
    assert node.last_line(str(log)) == Node.last_line(node, str(log)) == "three"
    log.write_text('{"step": 1}\n{"step": 2}\n')
    assert node.last_line(str(log)).strip() == Node.last_line(node, str(log)).strip() == '{"step": 2}'
    assert node.group_alive(os.getpgid(0)) and not node.group_alive(2**22 - 3)
    assert node.read_text(str(tmp_path)) is None  # a folder: like `[ -f ] && cat`


def test_a_hung_connection_is_dropped_within_the_io_timeout(fresh_sshd, tmp_path):
    """sshd frozen (SIGSTOP): TCP stays up, nothing answers. Reads give up after io_timeout
    and the next call, once sshd is back, connects afresh."""
    import signal

    from tests.sshd import children_of

    server = fresh_sshd
    node = node_for(server, io_timeout=2)
    path = tmp_path / "status.json"
    path.write_text("{}")
    assert node.read_text(str(path)) == "{}"
    frozen = [server.proc.pid, *children_of(server.proc.pid)]
    for pid in frozen:
        os.kill(pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        with pytest.raises(RemoteError, match="connection lost"):
            node.read_text(str(path))
        assert time.monotonic() - start < 6
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
    assert node.read_text(str(path)) == "{}"
