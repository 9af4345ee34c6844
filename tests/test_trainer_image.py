"""The trainer image itself, cpu flavour, built for real (tests/trainer_image.py) and run in the
image engine: what is inside, the layer order, and what an SSH session into it sees whichever
way sshd was started (the image's entrypoint as RunPod runs it, or a plain `sshd -D` in place of
the entrypoint as Vast's SSH runtypes run it).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fakes.harness import wait_until
from tests.helpers import REPO, free_port
from tests.sshd import keygen
from tests.trainer_image import build_cpu_image, torch_pin

# the first test pays for the build: minutes cold, seconds with the layer cache
pytestmark = pytest.mark.timeout(2400)
SECRET = "rp-api-key-5e6f7a8b9c0d"  # a vendor-set secret: never written where sessions read env


def pin(name: str, package: str) -> str:
    text = (REPO / "images" / name).read_text()
    return next(line.split("==")[1] for line in text.splitlines() if line.startswith(f"{package}=="))


def ssh(port: int, key: Path, command: str, timeout: float = 120) -> subprocess.CompletedProcess:
    argv = ["ssh", "-p", str(port), "-i", str(key), "-o", "IdentitiesOnly=yes", "-o", "StrictHostKeyChecking=no"]
    argv += ["-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR", "-o", "BatchMode=yes", "-o"]
    argv += ["ConnectTimeout=5", "root@127.0.0.1", command]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


@contextlib.contextmanager
def container(image, *args: str) -> Iterator[str]:
    """docker run -d --network host ARGS IMAGE...; removed at the end. Yields its id."""
    out = image.engine.docker("run", "-d", "--network", "host", *args)
    cid = out.stdout.decode().strip()
    try:
        yield cid
    finally:
        image.engine.docker("rm", "-f", cid, check=False)


def wait_for_login(cid: str, image, port: int, key: Path) -> None:
    def ready() -> bool:
        state = image.engine.docker("inspect", "--format", "{{.State.Running}}", cid, check=False).stdout
        assert state.strip() != b"false", image.engine.docker("logs", cid, check=False).stderr.decode()[-2000:]
        return ssh(port, key, "true", timeout=30).returncode == 0

    wait_until(ready, 60, f"an SSH login on port {port}", every=0.3)


def test_cpu_image_has_the_pinned_stack_and_portable_prebuilt_ops(trainer_image, tmp_path):
    script = (
        "import os; os.makedirs('/tmp/ext')\n"
        "import json, torch, deepspeed, transformers, deepspeed.git_version_info as v\n"
        "from deepspeed.accelerator import get_accelerator as acc\n"
        "acc().create_op_builder('CPUAdamBuilder').load(); acc().create_op_builder('ShareMemCommBuilder').load()\n"
        "import deepspeed.ops.adam.cpu_adam_op as op\n"
        "print(json.dumps({'torch': torch.__version__, 'deepspeed': deepspeed.__version__,\n"
        "  'transformers': transformers.__version__, 'ops': sorted(k for k, on in v.installed_ops.items() if on),\n"
        "  'accelerator': acc()._name, 'so': op.__file__, 'jit': os.listdir('/tmp/ext')}))\n"
    )
    # TORCH_EXTENSIONS_DIR stays empty: the ops load prebuilt, nothing is JIT-compiled on the node
    out = trainer_image.run("env", "TORCH_EXTENSIONS_DIR=/tmp/ext", "python", "-c", script)
    found = json.loads(out.stdout.decode().strip().splitlines()[-1])
    assert found["torch"] == torch_pin() and found["deepspeed"] == pin("requirements-deepspeed.txt", "deepspeed")
    assert found["transformers"] == pin("requirements-train.txt", "transformers")
    assert found["ops"] == ["cpu_adam", "deepspeed_shm_comm"] and found["accelerator"] == "cpu"
    assert found["jit"] == []
    # built on an AVX-512 machine, CPU Adam must still run on an AVX2-only host: no zmm registers
    disasm = trainer_image.run("bash", "-c", f"objdump -d {found['so']} | grep -c -E 'zmm|ymm' || true")
    zmm = trainer_image.run("bash", "-c", f"objdump -d {found['so']} | grep -c zmm || true")
    assert int(disasm.stdout) > 100 and int(zmm.stdout) == 0  # AVX2 (ymm) yes, AVX-512 (zmm) no
    labels = json.loads(
        trainer_image.engine.docker("inspect", "--format", "{{json .Config.Labels}}", trainer_image.name).stdout
    )
    assert labels["org.gpuctl.flavour"] == "cpu" and labels["org.opencontainers.image.base.name"] == trainer_image.base
    assert labels["org.gpuctl.cpu-arch"] == "x86-64-v3"
    # no host key in any layer: the entrypoint makes them when it starts sshd, not before
    none = trainer_image.run("bash", "-c", "ls /etc/ssh/ssh_host_* 2>/dev/null | wc -l; echo ran")
    assert none.stdout.decode().split() == ["0", "ran"]


def test_a_trainer_change_rebuilds_only_the_last_layer(trainer_image, tmp_path):
    from provision.flows.context import context_files

    ctx = tmp_path / "ctx"
    for rel in context_files(REPO, "Dockerfile"):
        (ctx / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, ctx / rel)
    with open(ctx / "trainer" / "__init__.py", "a") as fh:
        fh.write("# touched by test_a_trainer_change_rebuilds_only_the_last_layer\n")
    lines: list[str] = []
    try:
        _, built = build_cpu_image(trainer_image.engine, "gpuctl-trainer:touched", ctx, say=lines.append)
        layers = {
            name: json.loads(trainer_image.engine.docker("inspect", "--format", "{{json .RootFS.Layers}}", name).stdout)
            for name in (trainer_image.name, "gpuctl-trainer:touched")
        }
    finally:
        trainer_image.engine.docker("rmi", "gpuctl-trainer:touched", check=False)
    old, new = layers[trainer_image.name], layers["gpuctl-trainer:touched"]
    assert len(old) == len(new) and old[:-1] == new[:-1] and old[-1] != new[-1]
    steps = step_cache(lines)
    copy = next(i for i, (instruction, _) in enumerate(steps) if instruction.startswith("COPY trainer/"))
    before = [(instr, cached) for instr, cached in steps[:copy] if not instr.startswith(("FROM", "ARG BASE_IMAGE"))]
    assert len(before) > 20 and [instr for instr, cached in before if not cached] == []
    assert not steps[copy][1] and built.cached_steps == len(before)


def step_cache(lines: list[str]) -> list[tuple[str, bool]]:
    """(instruction, answered from the layer cache) per step of the classic builder's output."""
    out = []
    for i, line in enumerate(lines):
        if line.startswith("Step "):
            following = next((x.strip() for x in lines[i + 1 :] if x.strip()), "")
            out.append((line.split(" : ", 1)[1], following == "---> Using cache"))
    return out


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("keys")
    return keygen(folder / "account"), keygen(folder / "pod")


VENDOR_ENV = ["-e", "NCCL_DEBUG=INFO", "-e", "GPUCTL_CLUSTER=img-test", "-e", f"RUNPOD_API_KEY={SECRET}"]
PROBE = (
    "command -v python; echo PATH=$PATH; echo DS=$DS_ACCELERATOR PP=$PYTHONPATH NCCL=$NCCL_DEBUG CL=$GPUCTL_CLUSTER; "
    "env | grep -c RUNPOD_API_KEY; bash -lc 'echo LOGIN=$PATH'; "
    "python -c 'import torch, deepspeed; print(\"imports\", torch.__version__)' 2>/dev/null | tail -1"
)


def session_view(out: subprocess.CompletedProcess) -> dict[str, str]:
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    view = {"python": lines[0], "secret_vars": lines[3], "imports": lines[5]}
    for line in (lines[1], lines[2], lines[4]):
        view.update(part.split("=", 1) for part in line.split(" "))
    return view


def test_entrypoint_starts_sshd_with_either_vendor_key_and_sessions_see_the_image_env(trainer_image, keys):
    account, pod = keys
    port = free_port()
    env = ["-e", f"PUBLIC_KEY={account.with_suffix('.pub').read_text()}", "-e", f"GPUCTL_SSHD_PORT={port}"]
    env += ["-e", "GPUCTL_SSHD_LISTEN=127.0.0.1"]  # the host's network: loopback only
    env += ["-e", f"SSH_PUBLIC_KEY={pod.with_suffix('.pub').read_text()}"]
    with container(trainer_image, *env, *VENDOR_ENV, trainer_image.name) as cid:
        wait_for_login(cid, trainer_image, port, account)
        for key in (account, pod):  # RunPod: account keys in PUBLIC_KEY, the pod's own in SSH_PUBLIC_KEY
            view = session_view(ssh(port, key, PROBE))
            assert view["python"] == "/opt/venv/bin/python" and view["PATH"].startswith("/opt/venv/bin:")
            assert view["LOGIN"] == view["PATH"]  # a login shell (/etc/profile resets PATH) sees the same
            assert view["DS"] == "cpu" and view["PP"] == "/opt/gpuctl" and view["imports"] == f"imports {torch_pin()}"
            assert view["NCCL"] == "INFO" and view["CL"] == "img-test"  # what the vendor set on the container
            assert view["secret_vars"] == "0"
        written = ssh(
            port, account, "cat /etc/environment /etc/ssh/sshd_config.d/gpuctl-env.conf /etc/profile.d/gpuctl-env.sh"
        )
        assert "NCCL_DEBUG" in written.stdout and SECRET not in written.stdout
        authorized = ssh(port, pod, "cat /root/.ssh/authorized_keys").stdout.splitlines()
        assert len(authorized) == 2  # each key once
        with pytest.raises(ConnectionRefusedError):  # GPUCTL_SSHD_LISTEN: 127.0.0.1 only, not 127.0.0.2
            socket.create_connection(("127.0.0.2", port), timeout=5).close()


@pytest.mark.parametrize("onstart", [False, True], ids=["no-onstart", "onstart-exports-env"])
def test_plain_sshd_in_place_of_the_entrypoint_still_gives_the_image_env(trainer_image, keys, tmp_path, onstart):
    """Vast's SSH runtypes: the entrypoint never runs; Vast installs the key and starts sshd -D,
    after the template's onstart (the vendor's example exports the container env there)."""
    account, _ = keys
    port = free_port()
    export = "env >> /etc/environment; " if onstart else ""
    boot = (
        f"mkdir -p /run/sshd /root/.ssh && cp /keys/key.pub /root/.ssh/authorized_keys && ssh-keygen -A >/dev/null"
        f" && {{ {export}true; }} && exec /usr/sbin/sshd -D -e -p {port} -o ListenAddress=127.0.0.1"
    )
    (tmp_path / "keys").mkdir()
    shutil.copy(account.with_suffix(".pub"), tmp_path / "keys" / "key.pub")
    args = ["-v", f"{tmp_path / 'keys'}:/keys:ro", *VENDOR_ENV, "--entrypoint", "bash", trainer_image.name, "-c", boot]
    with container(trainer_image, *args) as cid:
        wait_for_login(cid, trainer_image, port, account)
        view = session_view(ssh(port, account, PROBE))
    # what the build wrote is enough to train: the venv first on PATH, the accelerator, the trainer
    assert view["python"] == "/opt/venv/bin/python" and view["PATH"].startswith("/opt/venv/bin:")
    assert view["LOGIN"] == view["PATH"] and view["DS"] == "cpu" and view["PP"] == "/opt/gpuctl"
    assert view["imports"] == f"imports {torch_pin()}"
    # the container's runtime env arrives only through onstart (the entrypoint that would write it never ran)
    assert (view["NCCL"], view["CL"]) == (("INFO", "img-test") if onstart else ("", ""))


def test_no_key_and_no_gpuctl_sshd_starts_no_sshd(trainer_image):
    """runtime docker: `docker run IMAGE python ...` on a host with its own sshd."""
    out = trainer_image.run("bash", "-c", "ls /run/sshd.pid /etc/ssh/ssh_host_* 2>/dev/null | wc -l")
    assert out.stdout.strip() == b"0"


@pytest.mark.slow
def test_gpuctl_gpu_check_runs_in_the_image_on_cpu(trainer_image):
    """benchmarks/gpu_check.py's code path (--cpu-smoke: tiny width, CPU Adam offload, gloo) with
    the image's torch and prebuilt ops; on a GPU host the same script measures the cuda flavour."""
    rank = ["-e", "MASTER_ADDR=127.0.0.1", "-e", f"MASTER_PORT={free_port()}", "-e", "RANK=0", "-e", "WORLD_SIZE=1"]
    argv = ["run", "--rm", "--network", "host", "--shm-size", "1g", "-v", f"{REPO}:/src:ro", "-w", "/src", *rank]
    argv += [
        "-e",
        "LOCAL_RANK=0",
        trainer_image.name,
        "python",
        "benchmarks/gpu_check.py",
        "--cpu-smoke",
        "--steps",
        "3",
    ]
    argv += ["--warmup", "1"]
    out = trainer_image.engine.docker(*argv, check=False, timeout=600)
    text = out.stdout.decode()
    assert out.returncode == 0, text[-2000:] + out.stderr.decode()[-2000:]
    assert "step 3: loss" in text and "measured:" in text
