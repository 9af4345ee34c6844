"""What an SSH session on a Vast.ai instance sees, with a real container, sshd and PAM.

Vast's SSH runtype replaces the image's entrypoint with its own init (sshd, the attached keys),
then runs `onstart` with the container's environment; an SSH login gets only what PAM gives it.
Here a real dockerd (tests/dockerd.py) runs an image with the trainer image's ENV (read from the
real Dockerfile), Debian's sshd with UsePAM and pam_env, and a stand-in for Vast's init that
starts sshd and runs vast.ONSTART, the script gpuctl sends. Then paramiko logs in and reads
the session's environment: PATH to the image's venv python, PYTHONPATH, DS_ACCELERATOR, NCCL
and gpuctl variables, and no secret. The control: without the onstart, none of it is there.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import subprocess
import tarfile
import time
from pathlib import Path

import paramiko
import pytest

from provision.providers import vast
from tests.dockerd import BASE_IMAGE, _ldd
from tests.fakes.harness import wait_until
from tests.helpers import REPO, free_port

pytestmark = pytest.mark.timeout(600)
TOOLS = ("grep", "cut", "paste", "chmod", "touch", "ssh-keygen")
PAM_MODULES = ("pam_env.so", "pam_permit.so", "pam_deny.so")
SSHD_CONFIG = (
    "UsePAM yes\nPermitRootLogin prohibit-password\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
)
PAM_SSHD = "auth required pam_permit.so\naccount required pam_permit.so\npassword required pam_deny.so\nsession required pam_env.so readenv=1\n"
# Vast's init, as far as an SSH session can tell: host keys, sshd, then the onstart script
# (the onstart runs twice: Vast runs it at every start of the container, so it must be idempotent)
VAST_INIT = (
    "ssh-keygen -A >/dev/null && /usr/sbin/sshd -p $PORT"
    " && { [ ! -f /root/onstart.sh ] || { bash /root/onstart.sh && bash /root/onstart.sh; }; }"
    " && touch /run/ready && sleep infinity"
)


def dockerfile_env() -> list[str]:
    """The trainer image's ENV instructions, verbatim (continuations joined), after the ARG
    defaults (of the default, cuda, flavour) they refer to."""
    text = (REPO / "Dockerfile").read_text().replace("\\\n", " ")
    lines = text.splitlines()
    args = [line for line in lines if line.startswith("ARG ") and "=" in line]
    return args + [line for line in lines if line.startswith("ENV ")]


def _add(tar: tarfile.TarFile, path: str) -> None:
    arc = path.lstrip("/")
    if arc.startswith(("bin/", "lib/", "lib64/")):  # merged /usr, as the base rootfs has it
        arc = "usr/" + arc
    tar.add(os.path.realpath(path), arcname=arc)


def _text(tar: tarfile.TarFile, name: str, data: str, mode: int = 0o644) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data.encode()), mode
    tar.addfile(info, io.BytesIO(data.encode()))


def sshd_layer(out: Path, python: str) -> Path:
    """sshd with PAM, the tools the onstart uses, a stand-in venv python."""
    sshd = shutil.which("sshd", path="/usr/sbin:/sbin")
    if not sshd:
        pytest.skip("needs openssh-server's sshd")
    binaries = [sshd, *(shutil.which(t, path="/usr/bin:/bin") for t in TOOLS)]
    security = Path("/usr/lib/x86_64-linux-gnu/security")
    modules = [str(security / m) for m in PAM_MODULES]
    if None in binaries or not all(Path(m).exists() for m in modules):
        pytest.skip("needs grep, cut, paste, ssh-keygen and PAM's pam_env")
    libs = set().union(*(_ldd(b) for b in [*binaries, *modules]))
    with tarfile.open(out, "w") as tar:
        for path in sorted({*binaries, *modules, *libs}):
            _add(tar, path)
        for folder in ("etc/ssh", "run/sshd", "root/.ssh", "opt/venv/bin", "etc/security"):
            info = tarfile.TarInfo(folder)
            info.type, info.mode = tarfile.DIRTYPE, 0o700 if folder == "root/.ssh" else 0o755
            tar.addfile(info)
        link = tarfile.TarInfo("opt/venv/bin/python")
        link.type, link.linkname = tarfile.SYMTYPE, python
        tar.addfile(link)
        _text(tar, "etc/ssh/sshd_config", SSHD_CONFIG)
        _text(tar, "etc/pam.d/sshd", PAM_SSHD)
        _text(tar, "etc/security/pam_env.conf", "")
        # what the Dockerfile writes at build (PATH) plus a line of the image's own that must stay
        _text(tar, "etc/environment", 'PATH="/opt/venv/bin:/usr/local/bin:/usr/bin:/bin"\nLANG=C.UTF-8\n')
        passwd = "root:x:0:0:root:/root:/bin/bash\nsshd:x:100:65534::/run/sshd:/usr/sbin/nologin\n"
        _text(tar, "etc/passwd", passwd + "nobody:x:65534:65534:nobody:/nonexistent:/bin/false\n")
    return out


@pytest.fixture(scope="module")
def client_key(tmp_path_factory) -> Path:
    key = tmp_path_factory.mktemp("vastkey") / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True, timeout=60)
    return key


@pytest.fixture(scope="module")
def image(node_docker, tmp_path_factory, client_key) -> str:
    ctx = tmp_path_factory.mktemp("vastimg")
    sshd_layer(ctx / "sshd.tar", "/usr/bin/python3")
    (ctx / "onstart.sh").write_text(vast.ONSTART)
    shutil.copy(REPO / "images" / "entrypoint.sh", ctx / "entrypoint.sh")
    (ctx / "Dockerfile").write_text(
        f"FROM {BASE_IMAGE}\nADD sshd.tar /\nCOPY onstart.sh /root/onstart.sh\n"
        "COPY entrypoint.sh /usr/local/bin/gpuctl-entrypoint\n"
        + "\n".join(dockerfile_env())
        + '\nENTRYPOINT ["/usr/local/bin/gpuctl-entrypoint"]\n'  # the real image has tini in front
    )
    node_docker.docker("build", "-q", "-t", "gpuctl-vast-env:1", str(ctx), timeout=600)
    return "gpuctl-vast-env:1"


def login_env(port: int, key: Path, wait_s: float = 60) -> dict[str, str]:
    client = paramiko.SSHClient()
    client.set_missing_host_key_policy(paramiko.AutoAddPolicy())  # a throwaway container's fresh key
    deadline = time.monotonic() + wait_s
    while True:
        try:
            client.connect("127.0.0.1", port=port, username="root", key_filename=str(key), timeout=10)
            break
        except (OSError, paramiko.SSHException):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    try:
        _stdin, stdout, _stderr = client.exec_command("env; echo PYTHON=$(command -v python)", timeout=30)
        out = stdout.read().decode()
    finally:
        client.close()
    return dict(line.split("=", 1) for line in out.splitlines() if re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", line))


def run_like_vast(node_docker, image: str, port: int, key: Path, *, onstart: bool) -> str:
    env = {
        "GPUCTL_CLUSTER": "vast-env",  # what gpuctl's create sends in env
        "NCCL_P2P_DISABLE": "1",
        "GPUCTL_TEST_SPACES": "two words",
        "CONTAINER_API_KEY": "vast-instance-key-0123456789",  # Vast injects one: a secret
        "PORT": str(port),
    }
    init = VAST_INIT if onstart else VAST_INIT.replace("[ ! -f /root/onstart.sh ] ||", "true ||")
    args = ["create", "--network", "host", "--entrypoint", "bash"]  # Vast replaces the entrypoint
    for name, value in env.items():
        args += ["-e", f"{name}={value}"]
    container = node_docker.docker(*args, image, "-c", init).stdout.decode().strip()
    node_docker.docker("cp", str(key.with_suffix(".pub")), f"{container}:/root/.ssh/authorized_keys")  # attached key
    node_docker.docker("start", container)
    return container


def run_like_runpod(node_docker, image: str, port: int, env: dict[str, str]) -> str:
    """RunPod runs the image as it is: its entrypoint, with the pod's env."""
    args = ["run", "-d", "--network", "host", "-e", "GPUCTL_SSHD=1", "-e", f"GPUCTL_SSHD_PORT={port}"]
    for name, value in env.items():
        args += ["-e", f"{name}={value}"]
    return node_docker.docker(*args, image, "sleep", "infinity").stdout.decode().strip()


def test_an_ssh_session_on_vast_sees_the_image_env_through_onstart(node_docker, image, client_key):
    port = free_port()
    container = run_like_vast(node_docker, image, port, client_key, onstart=True)
    try:
        ready = ["exec", container, "bash", "-c", "[ -f /run/ready ]"]
        wait_until(lambda: node_docker.docker(*ready, check=False).returncode == 0, 60, "Vast's init and onstart")
        seen = login_env(port, client_key)
        environment = node_docker.docker("exec", container, "cat", "/etc/environment").stdout.decode()
    finally:
        node_docker.docker("rm", "-f", container, check=False)
    assert seen["PATH"].startswith("/opt/venv/bin:") and seen["PYTHON"] == "/opt/venv/bin/python"
    assert seen["PYTHONPATH"] == "/opt/gpuctl" and seen["DS_ACCELERATOR"] == "cuda"  # the Dockerfile's ENV
    assert seen["NCCL_P2P_DISABLE"] == "1" and seen["GPUCTL_CLUSTER"] == "vast-env"
    assert seen["GPUCTL_TEST_SPACES"] == "two words" and seen["LANG"] == "C.UTF-8"  # the file's own line stays
    assert "CONTAINER_API_KEY" not in seen and "vast-instance-key" not in environment
    assert "PORT" in seen  # a plain name passes; HOME and the like are sshd's, not copied
    assert environment.count("\nPATH=") + environment.startswith("PATH=") == 1  # idempotent: ran twice
    assert environment.count("GPUCTL_CLUSTER=") == 1


def test_without_the_onstart_an_ssh_session_misses_the_image_env(node_docker, image, client_key):
    port = free_port()
    container = run_like_vast(node_docker, image, port, client_key, onstart=False)
    try:
        ready = ["exec", container, "bash", "-c", "[ -f /run/ready ]"]
        wait_until(lambda: node_docker.docker(*ready, check=False).returncode == 0, 60, "Vast's init")
        seen = login_env(port, client_key)
    finally:
        node_docker.docker("rm", "-f", container, check=False)
    assert "DS_ACCELERATOR" not in seen and "GPUCTL_CLUSTER" not in seen and "NCCL_P2P_DISABLE" not in seen


def test_a_runpod_pod_takes_the_account_key_in_public_key_through_the_real_entrypoint(node_docker, image, client_key):
    """The harness's control: images/entrypoint.sh as it is installs PUBLIC_KEY and starts sshd."""
    port = free_port()
    container = run_like_runpod(node_docker, image, port, {"PUBLIC_KEY": client_key.with_suffix(".pub").read_text()})
    try:
        assert login_env(port, client_key)["HOME"] == "/root"  # logged in as root with that key
    finally:
        node_docker.docker("rm", "-f", container, check=False)


def test_a_runpod_pod_is_reachable_with_the_cluster_key_in_ssh_public_key(node_docker, image, client_key, tmp_path):
    """What gpuctl sends (SSH_PUBLIC_KEY = the cluster key) beside RunPod's account key (PUBLIC_KEY)."""
    other = tmp_path / "account"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True, timeout=60)
    port = free_port()
    env = {
        "SSH_PUBLIC_KEY": client_key.with_suffix(".pub").read_text(),
        "PUBLIC_KEY": other.with_suffix(".pub").read_text(),
    }
    container = run_like_runpod(node_docker, image, port, env)
    try:
        login_env(port, client_key, wait_s=20)  # the cluster key
        login_env(port, other, wait_s=20)  # and the account's own
    finally:
        node_docker.docker("rm", "-f", container, check=False)
