"""Runtime docker without an engine: the `docker run` argv, env by name, runtime choice, login."""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

import pytest
from pydantic import ValidationError

from provision.core.config import GpuctlConfig
from provision.core.errors import ConfigError
from provision.core.state import ClusterRecord, NodeRecord
from provision.flows import context, image, job
from provision.providers.base import resolve_runtime
from provision.transport.remote import CommandResult, Node

SECRET = "s3cr3t/Value+with$(chars)"
REPO = Path(__file__).resolve().parents[1]


def cluster(accelerator: str = "cuda", nodes: int = 1, gpu: str | None = "NVIDIA GeForce RTX 4090") -> ClusterRecord:
    recs = [
        NodeRecord(
            host=f"10.0.0.{i + 1}",
            address=f"10.0.0.{i + 1}",
            slots=3,
            accelerator=accelerator,
            gpu_name=gpu,
            workdir="/data/gpuctl",
        )
        for i in range(nodes)
    ]
    return ClusterRecord(name="c", provider="ssh", nodes=recs, runtime="docker", image="reg.example/trainer:1")


def spec_for(cfg: GpuctlConfig, rec: ClusterRecord, secrets: dict[str, str] | None = None):
    from provision.providers.base import SelfTeardown

    class Backend:  # what a cloud provider hands back for self-teardown: a secret in env
        def self_teardown(self, _cluster):
            return SelfTeardown(["teardown-node"], dict(secrets or {}))

    original = job.backend
    job.backend = lambda kind: Backend()
    try:
        return job.bundle_spec(cfg.model_copy(update={"teardown": "after-train"}), rec, "r1")
    finally:
        job.backend = original


def test_docker_run_argv_has_gpus_ipc_mounts_and_env_names():
    cfg = GpuctlConfig.model_validate(
        {"env": {"NCCL_DEBUG": "INFO"}, "docker": {"shm_size": "32g", "mounts": ["/datasets:/datasets:ro"]}}
    )
    spec = spec_for(cfg, cluster(), {"VAST_API_KEY": SECRET})
    argv = spec.launcher_prefix
    assert argv[:3] == ["docker", "run", "--rm"]
    assert argv[argv.index("--gpus") + 1] == "all"
    assert "--ipc=host" in argv and argv[argv.index("--network") + 1] == "host"
    assert argv[argv.index("--shm-size") + 1] == "32g"
    mounts = [argv[i + 1] for i, a in enumerate(argv) if a == "-v"]
    assert "/data/gpuctl/runs/r1:/data/gpuctl/runs/r1" in mounts
    assert "/data/gpuctl/cache:/data/gpuctl/cache" in mounts and "/datasets:/datasets:ro" in mounts
    assert argv[argv.index("-w") + 1] == "/data/gpuctl/runs/r1"
    env = [argv[i + 1] for i, a in enumerate(argv) if a == "-e"]
    # the ranks' env goes by NAME: docker copies the value from launch.sh's environment; the run's
    # secrets not at all (the ranks read the mounted run dir's secrets.env; -e would keep them in the
    # container's config)
    for name in ("NCCL_DEBUG", "NCCL_P2P_DISABLE"):
        assert name in env, name
    assert "VAST_API_KEY" not in env
    assert "PYTHONPATH=/data/gpuctl/runs/r1/lib:/opt/gpuctl" in env
    assert argv[argv.index("reg.example/trainer:1") - 1] != "-e"  # the image ends the docker part
    assert argv[-1] == "reg.example/trainer:1" and spec.python == "python3"


def test_cpu_node_gets_no_gpus_flag():
    spec = spec_for(GpuctlConfig(), cluster(accelerator="cpu", gpu=None))
    assert "--gpus" not in spec.launcher_prefix
    assert "DS_ACCELERATOR" in spec.launcher_prefix


def test_secret_is_not_on_the_command_line_or_in_launch_sh(tmp_path):
    from provision.flows.render import render_bundle

    cfg = GpuctlConfig.model_validate({"provider": {"kind": "ssh", "hosts": ["root@10.0.0.1"]}})
    spec = spec_for(cfg, cluster(), {"VAST_API_KEY": SECRET})
    out = render_bundle(cfg, spec, tmp_path / "bundle")
    launch = (out / "launch.sh").read_text()
    assert SECRET not in launch and SECRET not in " ".join(spec.launcher_prefix)
    assert "VAST_API_KEY" not in launch and "docker run --rm" in launch
    assert SECRET in (out / "secrets.env").read_text()  # 0600, read by the ranks in the mounted run dir
    subprocess.run(["bash", "-n", str(out / "launch.sh")], check=True)
    # the launcher runs in the container: the docker argv comes right before python -m deepspeed
    line = next(text for text in launch.splitlines() if "deepspeed.launcher.runner" in text)
    words = shlex.split(line.replace('"$MASTER_PORT"', "PORT"))
    assert words[:2] == ["docker", "run"]
    assert words[words.index("reg.example/trainer:1") + 1 :][:4] == ["python3", "-u", "-m", "deepspeed.launcher.runner"]


def test_runtime_none_has_no_prefix():
    rec = cluster()
    rec.runtime = "none"
    assert spec_for(GpuctlConfig(), rec).launcher_prefix == []


def test_multinode_docker_is_a_clear_error():
    with pytest.raises(ConfigError, match="one node"):
        spec_for(GpuctlConfig(), cluster(nodes=2))


@pytest.mark.parametrize(
    "requested,kind,docker,image_name,expected",
    [
        ("auto", "vast", False, "x", "image"),
        ("auto", "runpod", False, "x", "image"),
        ("auto", "aws", False, "x", "docker"),
        ("auto", "ssh", True, "img:1", "docker"),
        ("auto", "ssh", True, None, "none"),
        ("auto", "ssh", False, "img:1", "none"),
        ("auto", "local", True, "img:1", "none"),
        ("none", "aws", True, "x", "none"),
        ("docker", "ssh", False, None, "docker"),
        ("image", "vast", False, "x", "image"),
        ("auto", "vast", False, None, "bootstrap"),  # no image of ours: the vendor's PyTorch image
        ("auto", "runpod", False, None, "bootstrap"),
        ("bootstrap", "vast", False, "x", "bootstrap"),
    ],
)
def test_runtime_resolution(requested, kind, docker, image_name, expected):
    assert resolve_runtime(requested, kind, image=image_name, has_docker=lambda: docker) == expected


def test_runtime_image_needs_an_image_provider():
    with pytest.raises(ConfigError, match="vast, runpod"):
        resolve_runtime("image", "ssh")
    with pytest.raises(ConfigError, match="runtime bootstrap needs .*vast, runpod"):
        resolve_runtime("bootstrap", "aws", image="x")
    with pytest.raises(ConfigError, match="needs provider.image"):
        resolve_runtime("image", "vast", image=None)


def test_cloud_provider_runtime_is_configurable():
    cfg = GpuctlConfig.model_validate({"provider": {"kind": "aws", "runtime": "none"}})
    assert cfg.provider.runtime == "none"
    with pytest.raises(ValidationError, match="shm_size"):
        GpuctlConfig.model_validate({"docker": {"shm_size": "lots"}})


class Recorder(Node):
    label = "rec"

    def __init__(self, rc: int = 0):
        self.calls: list[tuple[list[str], bytes | None]] = []
        self.rc = rc

    def run(self, argv, *, check=True, timeout=None, stream=None, stdin=None):
        self.calls.append((argv, stdin))
        return CommandResult(self.rc, "", "")


def test_registry_pull_sends_the_credential_on_stdin_only(monkeypatch):
    monkeypatch.setenv(image.USER_ENV, "robot")
    monkeypatch.setenv(image.PASSWORD_ENV, SECRET)
    node = Recorder()
    result = image.ship(node, "ghcr.io/acme/trainer:2", "pull", say=lambda _: None)
    assert result.action == "pulled"
    argvs = [argv for argv, _ in node.calls]
    assert all(SECRET not in " ".join(argv) for argv in argvs)
    assert not [a for a in argvs if a[:2] in (["docker", "login"], ["docker", "logout"])]  # nothing stored to undo
    pull, stdin = node.calls[0]
    assert pull == ["bash", "-c", image.PULL_SCRIPT, "gpuctl-pull", "ghcr.io/acme/trainer:2"]
    assert json.loads(stdin) == {"ServerURL": "ghcr.io", "Username": "robot", "Secret": SECRET}


def test_pull_without_credentials_does_not_log_in(monkeypatch):
    monkeypatch.delenv(image.USER_ENV, raising=False)
    monkeypatch.delenv(image.PASSWORD_ENV, raising=False)
    node = Recorder()
    image.ship(node, "trainer:2", "pull", say=lambda _: None)
    assert [argv[1] for argv, _ in node.calls] == ["pull", "image"]


@pytest.mark.parametrize(
    "ref,registry",
    [
        ("ghcr.io/a/b:1", "ghcr.io"),
        ("localhost:5000/x", "localhost:5000"),
        ("library/ubuntu:22.04", None),
        ("ubuntu", None),
        ("127.0.0.1:9/x:1", "127.0.0.1:9"),
    ],
)
def test_registry_of(ref, registry):
    assert image.registry_of(ref) == registry


def test_build_context_is_the_allow_list():
    files = context.context_files(REPO, "Dockerfile")
    assert {
        "Dockerfile",
        ".dockerignore",
        "images/entrypoint.sh",
        "images/requirements-torch-cuda.txt",
        "trainer/__init__.py",
    } <= set(files)
    assert not [f for f in files if f.startswith((".venv/", "provision/", "tests/", ".git/"))]
    assert not [f for f in files if "__pycache__" in f or f.endswith(".pyc")]


def test_dockerignore_semantics(tmp_path):
    ctx = tmp_path / "ctx"
    for rel in ("Dockerfile", "a/keep.txt", "a/drop.log", "b/x/y.log", "c/z.txt", "top.log"):
        (ctx / rel).parent.mkdir(parents=True, exist_ok=True)
        (ctx / rel).write_text(rel)
    (ctx / ".dockerignore").write_text("*.log\n**/*.log\nc\n!a/drop.log\n")
    assert context.context_files(ctx, "Dockerfile") == [".dockerignore", "Dockerfile", "a/drop.log", "a/keep.txt"]

    def digest() -> str:
        with open(tmp_path / "ctx.tar", "wb") as out:
            return image.context_tar(ctx, "Dockerfile", out)

    first = digest()
    assert first == digest()  # contents and modes, not mtimes
    (ctx / "a" / "keep.txt").write_text("changed")
    assert first != digest()


FAKE_DOCKER = """#!/usr/bin/env bash
# records each docker call; `login` also records what arrived on stdin
printf '%s\\n' "$*" >> "$FAKE_DOCKER_LOG"
case "$1" in
  login) printf 'stdin=%s\\n' "$(cat)" >> "$FAKE_DOCKER_LOG" ;;
  image) echo "sha256:$(printf %064d 7)" ;;
  build) echo "Step 1/1 : FROM scratch" ;;
esac
"""


def test_image_build_push_logs_in_with_stdin_and_out_again(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from provision.cli.app import app

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text(FAKE_DOCKER)
    (bin_dir / "docker").chmod(0o755)
    log = tmp_path / "docker.log"
    monkeypatch.setenv("PATH", f"{bin_dir}:{__import__('os').environ['PATH']}")
    monkeypatch.setenv("FAKE_DOCKER_LOG", str(log))
    monkeypatch.setenv(image.USER_ENV, "robot")
    monkeypatch.setenv(image.PASSWORD_ENV, SECRET)
    (tmp_path / "gpuctl.yaml").write_text("provider: {kind: aws, image: reg.example/gpuctl/trainer:7}\n")
    result = CliRunner().invoke(app, ["image", "build", "--push", "-c", str(tmp_path / "gpuctl.yaml")])
    assert result.exit_code == 0, result.output
    calls = log.read_text().splitlines()
    assert calls[0].startswith("build -t reg.example/gpuctl/trainer:7 -f ")
    assert f"{REPO}/Dockerfile" in calls[0] and calls[0].endswith(str(REPO)) and "VCS_REF=" in calls[0]
    assert calls[1:5] == [
        "login --username robot --password-stdin reg.example",
        f"stdin={SECRET}",
        "push reg.example/gpuctl/trainer:7",
        "logout reg.example",
    ]
    assert all(SECRET not in c for c in calls if not c.startswith("stdin="))
    assert "Step 1/1" in result.output and "pushed" in result.output


def test_dry_run_shows_the_docker_wrapper(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from provision.cli.app import app

    monkeypatch.chdir(tmp_path)
    (tmp_path / "gpuctl.yaml").write_text(
        "provider: {kind: ssh, hosts: [me@10.1.2.3], runtime: docker, image: reg.example/t:1, gpus_per_node: 3}\n"
        "train: {grad_accum: 4}\n"
    )
    result = CliRunner().invoke(app, ["train", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "docker run --rm --init" in result.output and "--gpus all" in result.output
    assert "reg.example/t:1 python3 -u -m deepspeed.launcher.runner" in result.output


class Scripted(Node):
    """A node whose docker answers from a table: argv[1] -> (rc, stdout)."""

    label = "scripted"

    def __init__(self, answers: dict[str, tuple[int, str]]):
        self.answers = answers
        self.calls: list[list[str]] = []

    def run(self, argv, *, check=True, timeout=None, stream=None, stdin=None):
        self.calls.append(argv)
        rc, out = self.answers.get(argv[1], (0, ""))
        return CommandResult(rc, out, "" if rc == 0 else f"{argv[1]} failed")


def test_failed_pull_falls_back_to_the_copy_the_node_has(monkeypatch):
    monkeypatch.delenv(image.USER_ENV, raising=False)
    node = Scripted({"pull": (1, ""), "image": (0, "sha256:" + "a" * 64)})
    said: list[str] = []
    result = image.ship(node, "ghcr.io/acme/t:1", "pull", say=said.append)
    assert result.action == "skipped" and result.image_id == "sha256:" + "a" * 64
    assert any("warning" in line and "already has" in line for line in said)
    bare = Scripted({"pull": (1, ""), "image": (1, "")})
    with pytest.raises(Exception, match="docker pull failed"):
        image.ship(bare, "ghcr.io/acme/t:1", "pull", say=said.append)


def test_auto_without_docker_here_pulls_on_the_node(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no docker binary on this "laptop"
    monkeypatch.delenv(image.USER_ENV, raising=False)
    node = Scripted({"image": (0, "sha256:" + "b" * 64)})
    assert image.ship(node, "ghcr.io/acme/t:1", "auto", say=lambda _: None).action == "pulled"
    with pytest.raises(Exception, match="docker is not installed here"):
        image.ship(node, "ghcr.io/acme/t:1", "load", say=lambda _: None)
