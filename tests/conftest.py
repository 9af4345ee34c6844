"""Shared fixtures. Every test gets its own gpuctl state dir.

The fixture modules are registered here once: a test asks for ``sshd``, ``fresh_sshd``,
``s3_env``, ``s3_server``, ``fresh_bucket``, ``laptop_docker``, ``node_docker``,
``trainer_image`` ... by argument name and never imports a fixture. Plain helpers come from
``tests.helpers`` and the modules below.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers import REPO, Gpuctl

pytest_plugins = ["tests.sshd", "tests.bastion", "tests.s3server", "tests.dockerd", "tests.trainer_image"]

# DeepSpeed JIT-compiles its CPU ops once; share the cache across tests and runs.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))


@pytest.fixture(autouse=True)
def state_dir(tmp_path_factory, monkeypatch) -> Path:
    path = tmp_path_factory.mktemp("state")
    monkeypatch.setenv("GPUCTL_STATE_DIR", str(path))
    return path


@pytest.fixture
def project(tmp_path, monkeypatch) -> Path:
    """An empty project folder as the cwd."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def gpuctl(project) -> Gpuctl:
    """gpuctl as a subprocess in the test's project folder, with this process's environment at
    each call: ``gpuctl("up", "--yes", env={"KEY": "v"}, timeout=60, check=True, input="n\\n")``
    (``env`` is laid over os.environ; ``cwd=`` picks another folder)."""
    return Gpuctl(project)
