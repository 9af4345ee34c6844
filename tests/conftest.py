"""Shared fixtures. Every test gets its own gpuctl state dir."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
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
