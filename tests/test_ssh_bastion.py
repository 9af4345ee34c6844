"""SSH hosts the way users reach them: ~/.ssh/config aliases, ProxyJump through a bastion, keys
in ssh-agent. Real OpenSSH servers: the bastion on 127.0.0.1, the nodes in a network namespace
only the bastion reaches (tests/bastion.py); real DeepSpeed ranks where a run trains.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.bastion import NODE_ADDRESSES, Bastion, NodeNet
from tests.fakes.harness import wait_until
from tests.sshd import keygen

pytestmark = pytest.mark.timeout(600)
EXTENSIONS = os.environ.get(
    "TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parents[1] / ".cache" / "torch_extensions")
)


def ssh_config(path: Path, blocks: dict[str, dict[str, object]]) -> Path:
    """An OpenSSH client config: {alias: {Option: value}}."""
    text = "".join(f"Host {name}\n" + "".join(f"  {k} {v}\n" for k, v in opts.items()) for name, opts in blocks.items())
    path.write_text(text)
    return path


def write_project(project: Path, hosts: list[str], *, name: str, cpu_ranks: int = 1, **provider: object) -> Path:
    cfg = {
        "name": name,
        "provider": {
            "kind": "ssh",
            "hosts": hosts,
            "python": sys.executable,
            "cpu_ranks": cpu_ranks,
            "workdir": str(project / "node"),
            "ready_timeout": 20,
            "connect_timeout": 5,
            **provider,
        },
        "train": {"max_steps": 4, "checkpoint_every": 0, "seed": 1234, "offload_optimizer": "none"},
        "storage": {"url": str(project / "store")},
        "env": {"TORCH_EXTENSIONS_DIR": EXTENSIONS},
    }
    project.mkdir(parents=True, exist_ok=True)
    (project / "gpuctl.yaml").write_text(yaml.safe_dump(cfg))
    return project


def one_line_error(out: subprocess.CompletedProcess) -> str:
    assert out.returncode != 0, out.stdout + out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]  # (before it: e.g. a key pinned on first contact)
    assert errors == lines[-1:], out.stderr
    return errors[0]


def unreachable(address: str, port: int) -> bool:
    try:
        socket.create_connection((address, port), timeout=2).close()
    except OSError:
        return True
    return False


@pytest.fixture
def agent(tmp_path):
    """ssh-agent started for the test, holding a passphrase-protected key that is nowhere else
    usable (the file needs the passphrase; no identity_file points at it)."""
    folder = tmp_path / "agent"
    folder.mkdir()
    key = folder / "id_locked"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "s3cret-phrase", "-f", str(key)], check=True, timeout=30)
    sock = folder / "agent.sock"
    proc = subprocess.Popen(["ssh-agent", "-D", "-a", str(sock)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(sock.exists, 10, "the agent's socket", every=0.05)
        askpass = folder / "askpass"
        askpass.write_text("#!/bin/sh\necho s3cret-phrase\n")
        askpass.chmod(0o700)
        env = {**os.environ, "SSH_AUTH_SOCK": str(sock), "SSH_ASKPASS": str(askpass), "SSH_ASKPASS_REQUIRE": "force"}
        subprocess.run(["ssh-add", str(key)], env=env, stdin=subprocess.DEVNULL, check=True, timeout=30)
        yield sock, Path(f"{key}.pub").read_text()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)


@pytest.fixture
def home(tmp_path) -> Path:
    """A HOME of the laptop's own: its ~/.ssh holds only what the test writes."""
    path = tmp_path / "home"
    (path / ".ssh").mkdir(parents=True)
    return path


# --- fast: resolution and refusals ------------------------------------------------------------


def test_alias_with_user_port_identityfile_only(sshd, gpuctl, home, project):
    ssh_config(
        home / ".ssh" / "config",
        {"box": {"HostName": "127.0.0.1", "Port": sshd.port, "User": sshd.user, "IdentityFile": sshd.client_key}},
    )
    write_project(project, ["box"], name="alias", authorized_keys=str(sshd.authorized_keys))
    env = {"HOME": str(home)}  # the default ~/.ssh/config
    up = gpuctl("up", env=env, timeout=120)
    assert up.returncode == 0, up.stderr
    node = json.loads(gpuctl("status", "--json", env=env).stdout)["cluster"]["nodes"][0]
    assert (node["address"], node["port"], node["user"]) == ("127.0.0.1", sshd.port, sshd.user)
    assert node["ssh"]["alias"] == "box" and node["ssh"]["identity_files"] == [str(sshd.client_key)]
    where = gpuctl("ssh", 'printf "%s" "${SSH_CONNECTION##* }"', env=env, timeout=60)
    assert where.returncode == 0 and where.stdout == str(sshd.port), where.stderr
    assert gpuctl("down", env=env, timeout=120).returncode == 0


def test_unknown_alias_is_one_line_naming_the_field(gpuctl, home, project):
    ssh_config(home / ".ssh" / "config", {"gpu-box": {"HostName": "127.0.0.1"}})
    write_project(project, ["gpu-box", "gpu-bx"], name="typo")
    out = gpuctl("up", env={"HOME": str(home)}, timeout=60)
    line = one_line_error(out)
    assert "provider.hosts[1] 'gpu-bx'" in line and "~/.ssh/config" in line and "Host gpu-bx" in line, line
    missing = write_project(project, ["gpu-box"], name="typo", ssh_config=str(project / "nope"))
    line = one_line_error(gpuctl("up", env={"HOME": str(home)}, timeout=60))
    assert f"provider.ssh_config: {missing / 'nope'} does not exist" in line, line


def behind(net: NodeNet, bastion: Bastion, path: Path, **jump: object) -> Path:
    """A user's ssh_config: `jump` (the bastion) and `gpu-a`/`gpu-b` (the nodes) behind it."""
    key = {"IdentityFile": net.sshd.client_key}
    blocks: dict[str, dict[str, object]] = {
        "jump": {"HostName": "127.0.0.1", "Port": bastion.port, "User": net.sshd.user, **key, **jump}
    }
    for name, address in zip(("gpu-a", "gpu-b"), NODE_ADDRESSES, strict=True):
        blocks[name] = {"HostName": address, "Port": net.sshd.port, **key, "ProxyJump": "jump"}
    return ssh_config(path, blocks)


def test_bastion_that_refuses_and_a_changed_bastion_key(node_net, gpuctl, project, tmp_path):
    net = node_net
    closed = net.bastion("closed")
    closed.stop()
    write_project(project, ["gpu-a"], name="refused", ssh_config=str(behind(net, closed, tmp_path / "c1")))
    line = one_line_error(gpuctl("up", timeout=60))  # not retried until ready_timeout: a bastion does not boot
    assert f"jump host {net.sshd.user}@127.0.0.1:{closed.port}: connection refused" in line, line

    no_forward = net.bastion("noforward", forwarding=False)
    write_project(project, ["gpu-a"], name="refused", ssh_config=str(behind(net, no_forward, tmp_path / "c2")))
    line = one_line_error(gpuctl("up", timeout=60))
    assert f"jump host {net.sshd.user}@127.0.0.1:{no_forward.port} refused to forward" in line, line
    assert "AllowTcpForwarding" in line

    stranger = keygen(tmp_path / "stranger")  # a key the bastion does not know
    config = behind(net, no_forward, tmp_path / "c2b", IdentityFile=stranger, IdentitiesOnly="yes")
    write_project(project, ["gpu-a"], name="refused", ssh_config=str(config))
    line = one_line_error(gpuctl("up", timeout=60))
    assert f"jump host {net.sshd.user}@127.0.0.1:{no_forward.port}: authentication failed" in line, line
    assert "ssh-add" in line

    bastion = net.bastion("rekeyed")
    config = behind(net, bastion, tmp_path / "c3")
    write_project(project, ["gpu-a"], name="rekey", ssh_config=str(config))
    up = gpuctl("up", timeout=120)
    assert up.returncode == 0, up.stderr
    assert f"[127.0.0.1]:{bastion.port}: pinned host key" in up.stderr  # the bastion's key is pinned too
    bastion.new_host_key()
    line = one_line_error(gpuctl("train", "--detach", timeout=60))
    assert f"jump host {net.sshd.user}@127.0.0.1:{bastion.port}: host key CHANGED" in line, line
    assert "refusing to connect" in line
    state_dir = Path(os.environ["GPUCTL_STATE_DIR"])
    refused = subprocess.run(
        ["ssh", "-F", str(state_dir / "ssh_config"), "-o", "BatchMode=yes", "gpuctl-rekey", "true"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode != 0 and "HOST IDENTIFICATION HAS CHANGED" in refused.stderr, refused.stderr
    bastion.stop()
    assert gpuctl("down", timeout=120).returncode == 0


# --- slow: real runs through the bastion --------------------------------------------------------


@pytest.mark.slow
def test_up_train_logs_and_ssh_through_proxyjump_with_an_agent_only_key(
    node_net, agent, gpuctl, project, home, tmp_path
):
    net = node_net
    sock, public = agent
    with open(net.sshd.authorized_keys, "a") as fh:  # the bastion reads the same file
        fh.write(public)
    bastion = net.bastion("agent")
    config = ssh_config(
        tmp_path / "ssh_config",
        {
            "jump": {"HostName": "127.0.0.1", "Port": bastion.port, "User": net.sshd.user},
            "gpu-box": {"HostName": NODE_ADDRESSES[0], "Port": net.sshd.port, "ProxyJump": "jump"},
        },
    )
    assert unreachable(NODE_ADDRESSES[0], net.sshd.port)  # only the bastion reaches the node
    write_project(project, ["gpu-box"], name="jumped", ssh_config=str(config))
    gpuctl.env = {**os.environ, "HOME": str(home), "SSH_AUTH_SOCK": str(sock)}  # no key files anywhere
    up = gpuctl("up", timeout=120)
    assert up.returncode == 0, up.stderr
    assert f"[127.0.0.1]:{bastion.port}: pinned host key" in up.stderr
    assert f"[{NODE_ADDRESSES[0]}]:{net.sshd.port}: pinned host key" in up.stderr

    started = gpuctl("train", "--detach", timeout=300)
    assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-2000:]
    logs = gpuctl("logs", "-f", timeout=500)  # reattaches to the detached run and follows it to the end
    assert logs.returncode == 0, logs.stdout[-3000:] + logs.stderr[-2000:]
    assert "step 4/4" in logs.stdout and "succeeded" in logs.stdout + logs.stderr
    run = json.loads(gpuctl("status", "--json").stdout)["run"]
    assert run["state"] == "succeeded" and run["steps"] == 4

    summary = gpuctl("ssh", "cat", f"{run['run_dir']}/summary.json", timeout=60)
    assert summary.returncode == 0, summary.stderr
    assert json.loads(summary.stdout)["state"] == "succeeded"
    state_dir = Path(os.environ["GPUCTL_STATE_DIR"])
    written = (state_dir / "ssh_config").read_text()
    assert "ProxyJump gpuctl-jumped-0-jump0" in written and f"Port {bastion.port}" in written
    plain = subprocess.run(
        ["ssh", "-F", str(state_dir / "ssh_config"), "-o", "BatchMode=yes", "gpuctl-jumped", "echo", "$SSH_CONNECTION"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "SSH_AUTH_SOCK": str(sock)},
    )
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.split()[2:] == [NODE_ADDRESSES[0], str(net.sshd.port)]  # the node, reached via the bastion
    assert gpuctl("down", timeout=120).returncode == 0
    bastion.stop()


@pytest.mark.slow
def test_two_nodes_behind_the_bastion_rank_on_both(node_net, gpuctl, project, tmp_path):
    net = node_net
    bastion = net.bastion("multi")
    config = behind(net, bastion, tmp_path / "ssh_config")
    write_project(
        project, ["gpu-a", "gpu-b"], name="multi", ssh_config=str(config), authorized_keys=str(net.sshd.authorized_keys)
    )
    keys_before = net.sshd.authorized_keys.read_text()
    up = gpuctl("up", timeout=180)
    assert up.returncode == 0, up.stderr
    assert "node-to-node SSH ready" in up.stderr
    train = gpuctl("train", timeout=500)
    assert train.returncode == 0, train.stdout[-4000:] + train.stderr[-3000:]
    run = json.loads(gpuctl("status", "--json").stdout)["run"]
    log = Path(run["run_dir"], "job.log").read_text()
    # pdsh on the first node started a rank on the second over the private addresses
    assert f"{NODE_ADDRESSES[1]}: " in log and "node_rank=1" in log and "dist_world_size=2" in log
    assert Path(run["run_dir"], "hostfile").read_text() == f"{NODE_ADDRESSES[0]} slots=1\n{NODE_ADDRESSES[1]} slots=1\n"
    assert run["state"] == "succeeded" and run["world_size"] == 2
    assert gpuctl("down", timeout=120).returncode == 0
    assert net.sshd.authorized_keys.read_text() == keys_before
    bastion.stop()


def test_the_laptop_cannot_reach_the_nodes_directly(node_net):
    """The premise of the tests above: without the bastion there is no way in."""
    for address in NODE_ADDRESSES:
        assert unreachable(address, node_net.sshd.port)


def test_run_on_all_runs_the_command_on_every_node_at_once(sshd, tmp_path):
    """A rendezvous: each node waits for the other's mark, so it only ends if both run at once."""
    from provision.core.errors import RemoteError
    from provision.transport.ssh.group import run_on_all
    from provision.transport.ssh.node import SSHNode

    nodes = [SSHNode(a, sshd.port, sshd.user, str(sshd.client_key), pin_new=True) for a in ("127.0.0.1", "127.0.0.2")]
    meet = tmp_path / "meet"
    meet.mkdir()
    script = (
        'd=$1; set -- $SSH_CONNECTION; touch "$d/$3"; '
        'for i in $(seq 100); do [ "$(ls "$d" | wc -l)" -ge 2 ] && echo "$3 met $0" && exit 0; sleep 0.1; done; exit 1'
    )
    results = run_on_all(nodes, ["bash", "-c", script, "it's; $(quoted)", str(meet)], timeout=60)
    assert [r.stdout for r in results] == ["127.0.0.1 met it's; $(quoted)\n", "127.0.0.2 met it's; $(quoted)\n"]
    with pytest.raises(RemoteError, match=r"127\.0\.0\.1:\d+: bash exited 3"):
        run_on_all(nodes, ["bash", "-c", 'set -- $SSH_CONNECTION; [ "$3" = 127.0.0.2 ] || exit 3'], timeout=60)
    assert [r.rc for r in run_on_all(nodes, ["false"], timeout=60, check=False)] == [1, 1]
