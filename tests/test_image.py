"""Runtime docker end to end with real engines: build here, ship to a node over SSH, run there.

Two dockerds (tests/dockerd.py): "laptop" (DOCKER_HOST of this test process) and "node"
(DOCKER_HOST of every session the loopback sshd opens, via sshd's SetEnv). So the node is
this machine through SSH, but its images are its own: a transfer is real, and so is a skip.
The test image is a tiny rootfs plus a stand-in for DeepSpeed's launcher that records where
and with what it ran (no torch in the image: the point is the container plumbing).
"""

from __future__ import annotations

import hashlib
import json
import textwrap
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from provision.cli.app import app
from provision.core.errors import RemoteError
from provision.flows import image
from provision.providers.base import SelfTeardown
from provision.transport.ssh.node import SSHNode
from tests.dockerd import BASE_IMAGE
from tests.sshd import SSHD

runner = CliRunner()
SECRET = "tok-" + "9f3b" * 8
STUB_RUNNER = textwrap.dedent('''
    """Stand-in for deepspeed.launcher.runner in the test image: reports where and how it ran."""
    import hashlib, json, os, pathlib, signal, sys, time
    args = sys.argv[1:]
    if os.environ.get("GPUCTL_TEST_IGNORE_TERM"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print(f"stub launcher: in container={os.path.exists('/.dockerenv')} cwd={os.getcwd()}", flush=True)
    print("stub launcher: argv " + " ".join(args), flush=True)
    import trainer  # the run dir's lib/ through PYTHONPATH
    print(f"stub launcher: trainer from {os.path.dirname(trainer.__file__)}")
    print(f"stub launcher: secret in the launcher's env={'GPUCTL_TEST_SECRET' in os.environ}")
    from trainer import secrets_file  # what each rank does first: read the mounted run dir's secrets.env
    secrets_file.load(pathlib.Path.cwd())
    secret = os.environ.get("GPUCTL_TEST_SECRET", "")
    print(f"stub launcher: secret sha256 {hashlib.sha256(secret.encode()).hexdigest()[:16] if secret else None}")
    print(f"stub launcher: plain={os.environ.get('GPUCTL_TEST_PLAIN')} hf_home={os.environ.get('HF_HOME')}")
    time.sleep(float(os.environ.get("GPUCTL_TEST_SLEEP", "0")))
    if os.environ.get("GPUCTL_TEST_EXIT"):
        sys.exit(int(os.environ["GPUCTL_TEST_EXIT"]))
    run = json.load(open(args[-1]))
    steps = run["train"]["max_steps"]
    with open("metrics.jsonl", "w") as fh:
        for step in range(1, steps + 1):
            fh.write(json.dumps({"step": step, "loss": round(4.0 / step, 4), "tokens_per_s": 100.0}) + "\\n")
    with open("summary.json", "w") as fh:
        json.dump({"state": "succeeded", "steps": steps, "final_loss": round(4.0 / steps, 4), "world_size": 1}, fh)
''')


def write_context(folder: Path, marker: str = "1") -> Path:
    """A build context in the shape of the real one: FROM a base, then our code last."""
    (folder / "deepspeed" / "launcher").mkdir(parents=True, exist_ok=True)
    (folder / "deepspeed" / "__init__.py").write_text("")
    (folder / "deepspeed" / "launcher" / "__init__.py").write_text("")
    (folder / "deepspeed" / "launcher" / "runner.py").write_text(STUB_RUNNER)
    (folder / "marker.txt").write_text(marker)
    (folder / "junk.log").write_text("not shipped")
    (folder / ".dockerignore").write_text("*.log\n")
    (folder / "Dockerfile").write_text(
        textwrap.dedent(f"""\
        FROM {BASE_IMAGE}
        COPY deepspeed/ /opt/gpuctl/deepspeed/
        COPY marker.txt /opt/gpuctl/marker.txt
        """)
    )  # few steps: the vfs driver copies the whole rootfs for every one
    return folder


@pytest.fixture(scope="module")
def node_sshd(tmp_path_factory, node_docker) -> SSHD:
    """The loopback sshd whose sessions talk to the "node" engine."""
    server = SSHD(tmp_path_factory.mktemp("dsshd"), session_env={"DOCKER_HOST": node_docker.host})
    yield server.start()
    server.stop()


@pytest.fixture
def laptop(laptop_docker, monkeypatch):
    monkeypatch.setenv("DOCKER_HOST", laptop_docker.host)
    return laptop_docker


@pytest.fixture
def node(node_sshd) -> SSHNode:
    handle = SSHNode("127.0.0.1", node_sshd.port, node_sshd.user, str(node_sshd.client_key), pin_new=True)
    yield handle
    handle.close()


def project(folder: Path, sshd: SSHD, env: dict[str, str] | None = None, **docker) -> Path:
    ctx = write_context(folder / "ctx")
    cfg = {
        "name": "dk",
        "provider": {
            "kind": "ssh",
            "hosts": [sshd.host()],
            "identity_file": str(sshd.client_key),
            "runtime": "docker",
            "image": "gpuctl-test:1",
            "workdir": str(folder / "node"),
            "cpu_ranks": 1,
        },
        "train": {"max_steps": 3, "grad_accum": 1},
        "env": {"GPUCTL_TEST_PLAIN": "visible", **(env or {})},
        "teardown": "after-train",
        # memlock=-1 is refused here (no CAP_SYS_RESOURCE to raise the hard limit)
        "docker": {"ship": "load", "context": str(ctx), "shm_size": "1g", "ulimits": ["stack=67108864"], **docker},
    }
    path = folder / "gpuctl.yaml"
    path.write_text(json.dumps(cfg))  # JSON is YAML
    return path


def ok(result) -> str:
    assert result.exit_code == 0, f"exit {result.exit_code}\n{result.output}\n{result.exception!r}"
    return result.output


def test_build_ship_run_in_docker_and_skip_the_second_ship(
    tmp_path,
    laptop,
    node_docker,
    node_sshd,
    monkeypatch,
):
    from provision.providers.ssh_hosts import SSHBackend

    # A secret the way cloud providers hand one over (self-teardown env): it must reach the
    # container's ranks without appearing on any command line, in docker's container config or the image.
    monkeypatch.setattr(
        SSHBackend, "self_teardown", lambda self, c: SelfTeardown(["true"], {"GPUCTL_TEST_SECRET": SECRET})
    )
    cfg = project(tmp_path, node_sshd)
    out = ok(runner.invoke(app, ["image", "build", "-c", str(cfg)]))
    assert "built gpuctl-test:1" in out
    local_id = laptop.image_id("gpuctl-test:1")
    assert local_id and node_docker.image_id("gpuctl-test:1") is None

    # up ships the image: docker save | ssh | load. --skip-doctor: this stub image has no torch, so the
    # quick checks would rightly fail it (test_trainer_image_e2e runs them inside the real image).
    out = ok(runner.invoke(app, ["up", "-c", str(cfg), "-y", "--skip-doctor"]))
    assert "sending gpuctl-test:1" in out and node_docker.image_id("gpuctl-test:1") == local_id

    result = runner.invoke(app, ["train", "-c", str(cfg), "-v"])  # ships again? no: same image ID there (-v: job.log)
    out = ok(result)
    assert "skipping the transfer" in out
    assert "stub launcher: in container=True" in out
    assert f"secret sha256 {hashlib.sha256(SECRET.encode()).hexdigest()[:16]}" in out
    assert "secret in the launcher's env=False" in out  # the rank read it from the file, not docker -e
    assert "plain=visible" in out and "hf_home=" + str(tmp_path / "node" / "cache" / "huggingface") in out
    assert f"trainer from {tmp_path}/node/runs/" in out  # the bundle's copy, mounted at the same path

    status = json.loads(ok(runner.invoke(app, ["status", "-c", str(cfg), "--json"])))
    assert status["run"]["state"] == "succeeded" and status["run"]["exit_code"] == 0
    assert status["run"]["steps"] == 3 and status["cluster"]["runtime"] == "docker"
    logs = ok(runner.invoke(app, ["logs", "-c", str(cfg)]))
    assert "gpuctl: run" in logs and "succeeded (exit 0)" in logs

    run_dir = Path(status["run"]["run_dir"])
    launch = (run_dir / "launch.sh").read_text()
    assert "docker run --rm --init" in launch and "GPUCTL_TEST_SECRET" not in launch
    assert "--gpus" not in launch  # a CPU node: --gpus all would fail without the NVIDIA runtime
    assert SECRET not in launch and not (run_dir / "secrets.env").exists()
    history = node_docker.docker("history", "--no-trunc", "gpuctl-test:1").stdout.decode()
    inspect = node_docker.docker("image", "inspect", "gpuctl-test:1").stdout.decode()
    assert SECRET not in history + inspect
    assert node_docker.docker("ps", "-aq").stdout.strip() == b""  # --rm: nothing left behind

    out = ok(runner.invoke(app, ["image", "ship", "-c", str(cfg)]))
    assert "skipped" in out and "sending" not in out
    ok(runner.invoke(app, ["down", "-c", str(cfg), "-y"]))


def wait_for_log(run_id: str, text: str, timeout: float = 60) -> None:
    from provision.core import state

    log = Path(state.load_run(run_id).run_dir) / "job.log"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.is_file() and text in log.read_text():
            return
        time.sleep(0.2)
    raise AssertionError(f"{text!r} not in {log}: {log.read_text() if log.is_file() else '(none)'}")


def test_failed_and_cancelled_runs_in_containers(tmp_path, laptop, node_sshd, node_docker):
    from provision.core import state
    from provision.flows import job

    cfg = project(tmp_path, node_sshd, env={"GPUCTL_TEST_EXIT": "3"})
    ok(runner.invoke(app, ["image", "build", "-c", str(cfg)]))
    ok(runner.invoke(app, ["up", "-c", str(cfg), "-y", "--skip-doctor"]))  # a stub image without torch
    try:
        result = runner.invoke(app, ["train", "-c", str(cfg)])
        assert result.exit_code == 3, result.output  # the container's exit code is the run's
        status = json.loads(ok(runner.invoke(app, ["status", "-c", str(cfg), "--json"])))
        assert status["run"]["state"] == "failed" and status["run"]["exit_code"] == 3

        # `gpuctl cancel`: TERM reaches the launcher through docker run's signal proxy and --init
        project(tmp_path, node_sshd, env={"GPUCTL_TEST_SLEEP": "300"})
        run_id = ok(runner.invoke(app, ["train", "-c", str(cfg), "-d"])).strip().splitlines()[-1]
        wait_for_log(run_id, "stub launcher: in container=True")
        ok(runner.invoke(app, ["cancel", run_id, "-c", str(cfg)]))
        status = json.loads(ok(runner.invoke(app, ["status", run_id, "--json"])))
        assert status["run"]["state"] == "cancelled"
        assert node_docker.docker("ps", "-aq").stdout.strip() == b""

        # a launcher that ignores TERM: after the grace the group is killed, and the container
        # its killed client leaves behind is removed by name
        project(tmp_path, node_sshd, env={"GPUCTL_TEST_SLEEP": "300", "GPUCTL_TEST_IGNORE_TERM": "1"})
        run_id = ok(runner.invoke(app, ["train", "-c", str(cfg), "-d"])).strip().splitlines()[-1]
        wait_for_log(run_id, "stub launcher: in container=True")
        assert job.cancel(state.load_run(run_id), grace_s=2)
        assert node_docker.docker("ps", "-aq").stdout.strip() == b""
    finally:
        ok(runner.invoke(app, ["down", "-c", str(cfg), "-y"]))


def test_build_on_the_node_from_a_streamed_context_then_skip(tmp_path, laptop, node, node_docker):
    from provision.core.config import GpuctlConfig

    ctx = write_context(tmp_path / "ctx", marker="built-there")
    cfg = GpuctlConfig.model_validate({"docker": {"context": str(ctx)}})
    lines: list[str] = []
    first = image.ship(node, "gpuctl-built:1", "build", cfg=cfg, say=lines.append)
    assert first.action == "built" and first.bytes_sent > 0
    assert laptop.image_id("gpuctl-built:1") is None  # built there, not here
    run = node_docker.docker("run", "--rm", "--network", "host", "gpuctl-built:1", "cat", "/opt/gpuctl/marker.txt")
    assert run.stdout == b"built-there"
    assert node_docker.docker(
        "run",
        "--rm",
        "--network",
        "host",
        "gpuctl-built:1",
        "ls",
        "/opt/gpuctl",
    ).stdout.split() == [b"deepspeed", b"marker.txt"]  # .dockerignore applied
    again = image.ship(node, "gpuctl-built:1", "build", cfg=cfg, say=lines.append)
    assert again.action == "skipped" and again.image_id == first.image_id
    (ctx / "marker.txt").write_text("changed")
    third = image.ship(node, "gpuctl-built:1", "build", cfg=cfg, say=lines.append)
    assert third.action == "built" and third.image_id != first.image_id


def test_load_reports_bytes_and_verifies_the_id(tmp_path, laptop, node, node_docker):
    laptop.docker("tag", BASE_IMAGE, "gpuctl-base-copy:1")
    result = image.ship(node, "gpuctl-base-copy:1", "auto", say=lambda _: None)  # auto + local copy = load
    assert result.action == "loaded" and result.bytes_sent > 10_000_000
    assert node_docker.image_id("gpuctl-base-copy:1") == laptop.image_id("gpuctl-base-copy:1")
    assert image.ship(node, "gpuctl-base-copy:1", "auto", say=lambda _: None).action == "skipped"


def test_pull_from_an_unreachable_registry_is_one_clear_error(laptop, node, monkeypatch):
    monkeypatch.setenv(image.USER_ENV, "robot")
    monkeypatch.setenv(image.PASSWORD_ENV, SECRET)
    with pytest.raises(RemoteError) as err:
        image.ship(node, "127.0.0.1:9/gpuctl/none:1", "pull", say=lambda _: None)
    assert "docker pull failed" in err.value.message and SECRET not in err.value.message
    monkeypatch.delenv(image.USER_ENV)
    with pytest.raises(RemoteError, match="docker pull failed"):
        image.ship(node, "127.0.0.1:9/gpuctl/none:1", "pull", say=lambda _: None)
