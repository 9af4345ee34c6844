"""images/session-env.py (gpuctl-session-env in the image) on this machine, under a scratch root:
which variables it publishes to SSH sessions, how each file reads back, and that sshd accepts
what it writes. tests/test_trainer_image.py checks the same through real sessions in the image."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from tests.helpers import REPO
from tests.sshd import SSHD_BIN, keygen

SCRIPT = REPO / "images" / "session-env.py"
ENV = {
    "PATH": "/opt/venv/bin:/usr/bin:/bin",
    "VIRTUAL_ENV": "/opt/venv",
    "PYTHONPATH": "/opt/gpuctl",
    "DS_ACCELERATOR": "cuda",
    "LD_LIBRARY_PATH": "/usr/local/nvidia/lib64",
    "NCCL_P2P_DISABLE": "1",
    "NCCL_SOCKET_IFNAME": "eth0,eth1",
    "GPUCTL_CLUSTER": "c1",
    "GPUCTL_NOTE": 'a "quoted" word and $dollar',  # only a shell-quoted file can carry this one
    "HF_TOKEN": "hf_secret",
    "RUNPOD_API_KEY": "rp_secret",
    "AWS_SECRET_ACCESS_KEY": "aws_secret",
    "PUBLIC_KEY": "ssh-ed25519 AAAA",
    "HOME": "/root",
    "UNRELATED": "x",
}


def run(root: Path, env: dict[str, str] = ENV) -> None:
    out = subprocess.run(
        ["python3", str(SCRIPT), "--root", str(root)], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr


def test_publishes_what_a_session_needs_and_never_a_secret(tmp_path):
    run(tmp_path)
    files = {
        name: (tmp_path / name).read_text()
        for name in ("etc/environment", "etc/ssh/sshd_config.d/gpuctl-env.conf", "etc/profile.d/gpuctl-env.sh")
    }
    for name, text in files.items():
        for secret in ("hf_secret", "rp_secret", "aws_secret", "ssh-ed25519", "UNRELATED", "HOME="):
            assert secret not in text, (name, secret)
        for wanted in (
            "PATH=",
            "VIRTUAL_ENV=",
            "PYTHONPATH=",
            "DS_ACCELERATOR=",
            "LD_LIBRARY_PATH=",
            "NCCL_P2P_DISABLE=",
            "GPUCTL_CLUSTER=",
        ):
            assert wanted in text, (name, wanted)
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o644
    # a value sshd_config and pam_env cannot quote is left out there, kept in the shell file
    assert (
        "GPUCTL_NOTE" not in files["etc/environment"]
        and "GPUCTL_NOTE" not in files["etc/ssh/sshd_config.d/gpuctl-env.conf"]
    )
    assert sum(line.startswith("SetEnv ") for line in files["etc/ssh/sshd_config.d/gpuctl-env.conf"].splitlines()) == 1


def test_a_login_shell_reads_back_the_exact_values(tmp_path):
    run(tmp_path)
    names = ["PATH", "NCCL_SOCKET_IFNAME", "GPUCTL_NOTE", "DS_ACCELERATOR"]
    script = f". {tmp_path}/etc/profile.d/gpuctl-env.sh; " + "; ".join(f'printf "%s\\n" "${n}"' for n in names)
    out = subprocess.run(["bash", "-c", script], env={}, capture_output=True, text=True, timeout=30)
    assert out.stdout.splitlines() == [ENV[n] for n in names]


def test_a_rerun_replaces_its_block_and_keeps_what_others_wrote(tmp_path):
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "environment").write_text('LANG="C.UTF-8"\n')
    run(tmp_path)
    with open(tmp_path / "etc" / "environment", "a") as fh:
        fh.write("VENDOR_VAR=from-onstart\n")  # what a vendor's `env >> /etc/environment` adds
    run(tmp_path, {**ENV, "GPUCTL_CLUSTER": "c2"})
    lines = (tmp_path / "etc" / "environment").read_text().splitlines()
    assert 'GPUCTL_CLUSTER="c2"' in lines and 'GPUCTL_CLUSTER="c1"' not in lines
    assert 'LANG="C.UTF-8"' in lines and "VENDOR_VAR=from-onstart" in lines
    assert sum(line.startswith("# >>> gpuctl") for line in lines) == 1
    assert lines.index("VENDOR_VAR=from-onstart") > lines.index('GPUCTL_CLUSTER="c2"')  # pam_env: later wins


@pytest.mark.skipif(not os.path.exists(SSHD_BIN), reason="needs openssh-server")
def test_sshd_accepts_the_setenv_file(tmp_path):
    run(tmp_path)
    key = keygen(tmp_path / "host_key", "host")
    config = tmp_path / "sshd_config"
    config.write_text(f"Include {tmp_path}/etc/ssh/sshd_config.d/*.conf\nHostKey {key}\nUsePAM no\n")
    out = subprocess.run([SSHD_BIN, "-t", "-f", str(config)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    dump = subprocess.run([SSHD_BIN, "-T", "-f", str(config)], capture_output=True, text=True, timeout=30).stdout
    setenv = [line.split(" ", 1)[1] for line in dump.splitlines() if line.startswith("setenv ")]  # one per variable
    assert "NCCL_SOCKET_IFNAME=eth0,eth1" in setenv and f"PATH={ENV['PATH']}" in setenv and len(setenv) == 8


def test_entrypoint_on_a_machine_without_the_image_tools_writes_nothing(tmp_path):
    """Run outside the image (here), the entrypoint must not touch this machine's /etc."""
    before = Path("/etc/environment").read_bytes() if Path("/etc/environment").exists() else None
    script = shutil.copy(REPO / "images" / "entrypoint.sh", tmp_path / "entrypoint.sh")
    out = subprocess.run([script, "true"], env={"PATH": os.environ["PATH"]}, capture_output=True, timeout=30)
    assert out.returncode == 0
    assert (Path("/etc/environment").read_bytes() if Path("/etc/environment").exists() else None) == before
