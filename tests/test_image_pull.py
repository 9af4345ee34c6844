"""`docker.ship: pull` with registry credentials leaves no credential on the node (issue 34, LOW).

Real parts: a registry with basic auth (tests/registry.py), the "node" dockerd behind a loopback sshd
(tests/dockerd.py), the real docker CLI. The node's HOME and TMPDIR are the test's folders, and its
`docker` is a spy in front of the real one: at the moment a pull starts it records which of the node's
files hold the password or the `user:password` docker login stores. `docker login` keeps the
credential in ~/.docker/config.json for as long as the pull runs (and for ever if the pull is cut off
before `docker logout`); gpuctl's pull keeps it in that one docker process's environment only.
"""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from provision.core.errors import RemoteError
from provision.flows import image
from provision.transport.ssh.node import SSHNode
from tests.dockerd import BASE_IMAGE, Dockerd
from tests.registry import Registry
from tests.sshd import SSHD
from tests.test_hardening_secrets import ArgvWatch

pytestmark = pytest.mark.timeout(300)
USER, PASSWORD = "robot", "pull-pw-" + "5e1f" * 6
NEEDLES = [PASSWORD, base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()]
SPY = """#!/bin/bash
if [ "$1" = pull ]; then
  { echo "pull DOCKER_CONFIG=${DOCKER_CONFIG:-}"; grep -rlF -f SPY/needles "$HOME" "$TMPDIR"; } >> SPY/pulls.log 2>&1
fi
exec REAL "$@"
"""


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    server = Registry(tmp_path_factory.mktemp("registry"), USER, PASSWORD).start()
    yield server
    server.stop()


@pytest.fixture
def pushed(registry, laptop_docker: Dockerd, tmp_path) -> str:
    """The test base image in the registry, pushed by the laptop's engine (the test's own login)."""
    ref = f"{registry.host}/gpuctl/base:1"
    env = {**laptop_docker.env, "DOCKER_CONFIG": str(tmp_path / "laptop-docker-config")}
    laptop_docker.docker("tag", BASE_IMAGE, ref)
    login = ["docker", "login", "--username", USER, "--password-stdin", registry.host]
    subprocess.run(login, env=env, input=PASSWORD.encode(), check=True, capture_output=True, timeout=60)
    subprocess.run(["docker", "push", ref], env=env, check=True, capture_output=True, timeout=240)
    return ref


@pytest.fixture
def node(tmp_path, node_docker: Dockerd):
    """An SSH node on node_docker whose home, temp dir and `docker` (the spy) are the test's."""
    home, tmp, spy = tmp_path / "home", tmp_path / "tmp", tmp_path / "spy"
    for folder in (home, tmp, spy, tmp_path / "sshd"):
        folder.mkdir()
    (spy / "needles").write_text("\n".join(NEEDLES) + "\n")
    (spy / "docker").write_text(SPY.replace("SPY", str(spy)).replace("REAL", shutil.which("docker") or "docker"))
    (spy / "docker").chmod(0o755)
    path = f"{spy}:{os.environ['PATH']}"
    env = {"DOCKER_HOST": node_docker.host, "HOME": str(home), "TMPDIR": str(tmp), "PATH": path}
    server = SSHD(tmp_path / "sshd", session_env=env).start()
    handle = SSHNode("127.0.0.1", server.port, server.user, str(server.client_key), pin_new=True)
    yield handle, home, tmp, spy
    handle.close()
    server.stop()


def holding_a_credential(*roots: Path) -> list[str]:
    return [
        str(p)
        for root in roots
        for p in root.rglob("*")
        if p.is_file() and any(n.encode() in p.read_bytes() for n in NEEDLES)
    ]


def test_pull_with_credentials_keeps_none_on_the_node(pushed, node, node_docker, monkeypatch):
    handle, home, tmp, spy = node
    assert handle.run(["bash", "-c", 'echo "$HOME $TMPDIR"; command -v docker']).stdout.split() == [
        str(home),
        str(tmp),
        str(spy / "docker"),
    ]  # the session is the one the spy watches
    monkeypatch.setenv(image.USER_ENV, USER)
    monkeypatch.setenv(image.PASSWORD_ENV, PASSWORD)
    with ArgvWatch(*NEEDLES) as argv:
        result = image.ship(handle, pushed, "pull", say=lambda _: None)
    assert result.action == "pulled" and result.image_id == node_docker.image_id(pushed) is not None
    log = (spy / "pulls.log").read_text().splitlines()
    # one pull, with a config of its own (not ~/.docker), and no file held the credential as it ran
    assert len(log) == 1 and log[0].startswith(f"pull DOCKER_CONFIG={tmp}/gpuctl-pull."), log
    assert argv.hits == []
    assert holding_a_credential(home, tmp) == [] and list(tmp.iterdir()) == []  # nothing left either
    assert not (home / ".docker").exists()  # the user's own docker config is not touched


def test_a_refused_credential_is_one_line_without_it_and_leaves_nothing(pushed, node, node_docker, monkeypatch):
    handle, home, tmp, _spy = node
    node_docker.docker("rmi", pushed, check=False)
    monkeypatch.setenv(image.USER_ENV, USER)
    monkeypatch.setenv(image.PASSWORD_ENV, PASSWORD + "-wrong")
    with pytest.raises(RemoteError) as err:
        image.ship(handle, pushed, "pull", say=lambda _: None)
    message = err.value.one_line()
    assert "docker pull failed" in message and PASSWORD not in message and "\n" not in message
    assert node_docker.image_id(pushed) is None
    assert list(tmp.iterdir()) == [] and not (home / ".docker").exists()
