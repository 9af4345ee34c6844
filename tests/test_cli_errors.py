"""The one error boundary: every command, fed bad input, answers one line with a fix and a
non-zero exit, never a traceback (GPUCTL_DEBUG=1 brings the traceback back)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from provision.cli.app import app
from provision.cli.boundary import as_gpuctl_error, guard

RUNNER = CliRunner()


def one_error_line(result) -> str:
    """The command failed through the boundary: exit != 0, one `error: ... (fix: ...)` line."""
    assert result.exit_code != 0, result.output
    assert isinstance(result.exception, SystemExit), repr(result.exception)  # mapped, not escaped
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and "(fix: " in errors[0], result.stderr
    assert "Traceback" not in result.output
    return errors[0]


@pytest.fixture
def config(project: Path) -> Path:
    path = project / "gpuctl.yaml"
    path.write_text("storage:\n  url: ./store\n")
    return path


def write_record(state_dir: Path, kind: str, name: str, text: str) -> Path:
    path = state_dir / kind / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def cluster_json(name: str, provider: str = "local") -> str:
    return json.dumps({"name": name, "provider": provider, "nodes": [{"host": "localhost", "workdir": "/tmp/x"}]})


def test_ckpt_pull_on_a_store_without_complete_checkpoint(config):
    line = one_error_line(RUNNER.invoke(app, ["ckpt", "pull", "-c", str(config)]))
    assert "no complete checkpoint" in line


def test_ckpt_pull_refuses_a_tag_that_is_a_path(config):
    line = one_error_line(RUNNER.invoke(app, ["ckpt", "pull", "../../etc", "-c", str(config)]))
    assert "invalid checkpoint tag" in line


@pytest.mark.parametrize("command", [["render", "-o", "out"], ["up"], ["train"], ["ckpt", "ls"], ["plan"]])
def test_a_config_that_is_not_utf8(project, command):
    bad = project / "bad.yaml"
    bad.write_bytes(b"name: caf\xe9\n")
    line = one_error_line(RUNNER.invoke(app, [*command, "-c", str(bad)]))
    assert "bad.yaml" in line and "UTF-8" in line


@pytest.mark.parametrize("command", [["status"], ["down", "--yes"], ["train"], ["ssh"], ["image", "ship"]])
def test_a_truncated_cluster_record(config, state_dir, command):
    from provision.core.config import load_config

    name = load_config(config).cluster_name
    path = write_record(state_dir, "clusters", name, cluster_json(name)[:25])
    before = path.read_bytes()
    line = one_error_line(RUNNER.invoke(app, [*command, "-c", str(config)]))
    assert str(path) in line
    assert path.read_bytes() == before  # nothing rewritten


@pytest.mark.parametrize("command", [["status"], ["down", "--yes"], ["logs"]])
def test_a_cluster_record_with_an_unknown_provider(config, state_dir, command):
    from provision.core.config import load_config

    name = load_config(config).cluster_name
    write_record(state_dir, "clusters", name, cluster_json(name, provider="acme"))
    run = {
        "run_id": "20260101-000000-abcd",
        "cluster": name,
        "run_dir": "/tmp/x",
        "bundle_dir": "/tmp/x",
        "world_size": 1,
        "train_batch_size": 4,
        "micro_batch": 1,
        "grad_accum": 4,
        "max_steps": 1,
    }
    write_record(state_dir, "runs", run["run_id"], json.dumps(run))
    line = one_error_line(RUNNER.invoke(app, [*command, "-c", str(config)]))
    assert "acme" in line


def test_a_run_record_with_a_wrong_type(config, state_dir):
    path = write_record(state_dir, "runs", "20260101-000000-abcd", json.dumps({"run_id": "x", "world_size": "three"}))
    line = one_error_line(RUNNER.invoke(app, ["logs", "20260101-000000-abcd"]))
    assert str(path) in line


@pytest.mark.parametrize(
    "command",
    [
        ["status", "--cluster", "../../etc/passwd"],
        ["logs", "../../x"],
        ["cancel", "../x"],
        ["down", "--yes", "--cluster", "/etc/x"],
    ],
)
def test_names_that_would_leave_the_state_dir(config, command):
    line = one_error_line(RUNNER.invoke(app, [*command, "-c", str(config)]))
    assert "is not one gpuctl makes" in line


@pytest.mark.parametrize(
    "command",
    [
        ["train"],
        ["cancel"],
        ["logs"],
        ["ssh"],
        ["image", "ship"],
        ["offers"],
        ["report"],
        ["init"],
        ["plan", "--model", "no-such-model"],
        ["plan", "--gpu", "no-such-gpu"],
        ["forget-host", "a b"],
    ],
)
def test_every_command_without_what_it_needs(config, command):
    if command == ["init"]:
        command = ["init", str(config)]  # exists already
    elif command[0] not in ("report", "forget-host"):
        command = [*command, "-c", str(config)]
    one_error_line(RUNNER.invoke(app, command))


def test_report_of_a_run_without_metrics(config, state_dir, tmp_path):
    run = {
        "run_id": "20260101-000000-abcd",
        "cluster": "gone",
        "run_dir": str(tmp_path),
        "bundle_dir": "/tmp/x",
        "world_size": 1,
        "train_batch_size": 4,
        "micro_batch": 1,
        "grad_accum": 4,
        "max_steps": 1,
    }
    write_record(state_dir, "runs", run["run_id"], json.dumps(run))
    line = one_error_line(RUNNER.invoke(app, ["report", "-o", str(tmp_path / "r")]))
    assert "no metrics" in line


def test_library_errors_map_to_one_line():
    import filelock
    import paramiko
    from pydantic import BaseModel

    class Model(BaseModel):
        n: int

    with pytest.raises(Exception) as caught:
        Model.model_validate({"n": "x"})
    cases = [
        filelock.Timeout("/state/lock"),
        paramiko.BadHostKeyException(
            "h",
            paramiko.Ed25519Key.generate()
            if hasattr(paramiko.Ed25519Key, "generate")
            else paramiko.RSAKey.generate(1024),
            paramiko.RSAKey.generate(1024),
        ),
        paramiko.SSHException("Error reading SSH protocol banner"),
        caught.value,
        PermissionError(13, "Permission denied", "/x"),
        b"\xe9".decode("utf-8", "replace") and UnicodeDecodeError("utf-8", b"\xe9", 0, 1, "invalid continuation byte"),
    ]
    for exc in cases:
        mapped = as_gpuctl_error(exc)
        assert mapped is not None and mapped.fix, exc
    assert as_gpuctl_error(ZeroDivisionError()) is None  # a bug keeps its traceback


def test_guard_exits_with_the_mapped_code_and_debug_reraises(monkeypatch, capsys):
    import typer

    from provision.core.errors import NotFoundError

    def boom():
        raise NotFoundError("no such thing", "make it")

    with pytest.raises(typer.Exit) as stopped:
        guard(boom)()
    assert stopped.value.exit_code == NotFoundError.exit_code
    assert capsys.readouterr().err.strip() == "error: no such thing (fix: make it)"
    monkeypatch.setenv("GPUCTL_DEBUG", "1")
    with pytest.raises(NotFoundError):
        guard(boom)()


def test_a_real_process_prints_no_traceback(project):
    (project / "gpuctl.yaml").write_bytes(b"\xff\xfe not yaml")
    env = {k: v for k, v in os.environ.items() if k != "GPUCTL_DEBUG"}
    done = subprocess.run(
        [sys.executable, "-m", "provision.cli", "render", "-o", "x"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and done.stderr.startswith("error: ")
    env["GPUCTL_DEBUG"] = "1"
    loud = subprocess.run(
        [sys.executable, "-m", "provision.cli", "render", "-o", "x"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "Traceback" in loud.stderr
