"""DeepSpeed's JIT op cache stays built: one ninja per Python environment, one cache folder per
environment (two ninja versions or two venvs in one folder rebuild each other's ops every run)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from provision.core.config import GpuctlConfig
from provision.flows.render import BundleNode, BundleSpec, render_bundle
from tests.helpers import REPO
from trainer import hostenv


def test_the_environments_ninja_goes_first_on_path(tmp_path):
    venv_bin = tmp_path / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "ninja").write_text("#!/bin/sh\n")
    (venv_bin / "ninja").chmod(0o755)
    env = {"PATH": f"/usr/bin:{venv_bin}:/bin"}  # a login PATH: the system ninja would win
    assert hostenv.env_tools_first(env, executable=str(venv_bin / "python")) is True
    assert env["PATH"] == f"{venv_bin}:/usr/bin:/bin"
    assert hostenv.env_tools_first(env, executable=str(venv_bin / "python")) is False  # once is enough
    assert env["PATH"] == f"{venv_bin}:/usr/bin:/bin"


def test_without_a_ninja_of_its_own_path_is_left_alone(tmp_path):
    env = {"PATH": "/usr/bin:/bin"}
    assert hostenv.env_tools_first(env, executable=str(tmp_path / "python")) is False
    assert env == {"PATH": "/usr/bin:/bin"}


def ops_dir(launch_sh: Path, home: Path) -> str:
    """The TORCH_EXTENSIONS_DIR the rendered launch.sh exports (its own lines: the Python start that names
    the folder with the port, and the export; run by bash)."""
    lines = [
        line
        for line in launch_sh.read_text().splitlines()
        if line.startswith(("export TORCH_EXT", "{ IFS= read -r GPUCTL_OPS"))
    ]
    assert len(lines) == 2, lines
    env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"} | {"HOME": str(home)}
    env["PYTHONPATH"] = str(REPO)  # launch.sh has the shipped package on it (lib/)
    script = "\n".join([*lines, 'echo "$TORCH_EXTENSIONS_DIR"'])
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, check=True).stdout.strip()


def test_launch_keeps_one_op_cache_per_python_environment(tmp_path):
    other = tmp_path / "other-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(other)], check=True, timeout=120)
    found = {}
    for name, python in (("this", sys.executable), ("other", str(other / "bin" / "python"))):
        bundle = tmp_path / name
        spec = BundleSpec(run_id="r", run_dir=str(bundle), nodes=[BundleNode("localhost", 1)], python=python)
        render_bundle(GpuctlConfig.model_validate({}), spec, bundle)
        found[name] = ops_dir(bundle / "launch.sh", tmp_path)
    base = f"{tmp_path}/.cache/gpuctl/torch_extensions/"
    assert found["this"].startswith(base) and found["other"].startswith(base)
    assert found["this"] != found["other"]
    assert ops_dir(bundle / "launch.sh", tmp_path) == found["other"]  # the same environment: the same folder


def test_the_doctor_builds_into_the_folder_the_run_loads_from(tmp_path, monkeypatch):
    bundle = tmp_path / "bundle"
    spec = BundleSpec(run_id="r", run_dir=str(bundle), nodes=[BundleNode("localhost", 1)], python=sys.executable)
    render_bundle(GpuctlConfig.model_validate({}), spec, bundle)
    monkeypatch.setenv("HOME", str(tmp_path))
    env: dict[str, str] = {}
    assert hostenv.ops_cache_default(env) == ops_dir(bundle / "launch.sh", tmp_path)
    assert hostenv.ops_cache_default({"TORCH_EXTENSIONS_DIR": "/set"}) == "/set"  # a set folder wins
