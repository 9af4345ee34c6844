"""`gpuctl image build` without an engine: the build args of each flavour and the bad inputs.
The real builds run in tests/test_trainer_image.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from provision.core.errors import ConfigError
from provision.flows import build
from tests.helpers import REPO

PEM = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"


def test_cuda_is_the_dockerfiles_defaults_and_cpu_overrides_base_wheels_and_ops(tmp_path):
    cuda = build.build_args(build.BuildOptions(), REPO)
    assert set(cuda) == {"VCS_REF", "GPUCTL_VERSION"}  # nothing else: the Dockerfile's defaults are cuda
    ca = tmp_path / "ca.pem"
    ca.write_text(PEM)
    opts = build.BuildOptions(flavour="cpu", base="gpuctl-base:x", torch_index_url="http://127.0.0.1:1/", ca_certs=ca)
    cpu = build.build_args(opts, REPO)
    assert cpu["BASE_IMAGE"] == "gpuctl-base:x" and cpu["TORCH_INDEX_URL"] == "http://127.0.0.1:1/"
    assert cpu["FLAVOUR"] == "cpu" and cpu["DS_ACCELERATOR"] == "cpu" and cpu["BUILD_CA_CERTS"] == PEM.strip()
    default_cpu = build.build_args(build.BuildOptions(flavour="cpu"), tmp_path)  # not a checkout
    assert default_cpu["BASE_IMAGE"] == "debian:bookworm-slim" and default_cpu["VCS_REF"] == "unknown"
    assert default_cpu["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"


@pytest.mark.parametrize(
    "text,message",
    [
        (None, "No such file"),
        ("not a certificate\n", "not a PEM file"),
        (PEM * 2000, "not a PEM file of at most 64 KB"),  # a whole system bundle would not fit a build arg
    ],
)
def test_bad_ca_file_is_one_clear_error(tmp_path, text, message):
    path = tmp_path / "ca.pem"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        build.build_args(build.BuildOptions(ca_certs=path), REPO)


def test_unknown_flavour_is_one_line_from_the_cli(project, gpuctl):
    gpuctl("init", check=True)
    result = gpuctl("image", "build", "--flavour", "rocm")
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "image flavour 'rocm' is not one of cuda, cpu" in errors[0]
    assert "Traceback" not in result.stderr


def test_the_build_context_is_gpuctl_s_own_source_tree():
    from provision.flows import context

    assert context.source_tree() == Path(REPO)


# manylinux tags a Ubuntu 24.04 (glibc 2.39) x86-64 pip accepts, newest first
CUDA_BASE_PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in range(39, 4, -1)] + [
    "manylinux2014_x86_64",
    "manylinux2010_x86_64",
    "manylinux1_x86_64",
]


@pytest.mark.timeout(300)
def test_cuda_flavour_pins_resolve_together_for_its_python(tmp_path):
    """The cuda flavour's base cannot be pulled here, so its pip layers cannot run; resolve them
    instead, as that base's pip would (CPython 3.12, Ubuntu 24.04's glibc): torch's CUDA build
    with the trainer's pins. DeepSpeed, an sdist built against the installed torch, is left out."""
    import json
    import subprocess
    import sys

    argv = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--ignore-installed"]
    argv += ["--report", str(tmp_path / "report.json"), "--python-version", "3.12", "--only-binary=:all:"]
    argv += [arg for platform in CUDA_BASE_PLATFORMS for arg in ("--platform", platform)]
    argv += ["--target", str(tmp_path / "t"), "-r", str(REPO / "images" / "requirements-torch-cuda.txt")]
    argv += ["-r", str(REPO / "images" / "requirements-train.txt")]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stderr[-2000:]
    got = {
        re.sub(r"[-_.]+", "-", i["metadata"]["name"]).lower(): i["metadata"]["version"]
        for i in json.loads((tmp_path / "report.json").read_text())["install"]
    }
    torch_file = (REPO / "images" / "requirements-torch-cuda.txt").read_text()
    assert got["torch"] == re.search(r"^torch==(\S+)$", torch_file, re.M)[1]
    cuda = re.search(r"^# cuda: (\S+)$", torch_file, re.M)[1]
    assert got["nvidia-cuda-runtime-cu12"].startswith(cuda + ".")  # the base image's CUDA
    for line in (REPO / "images" / "requirements-train.txt").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==")
            assert got[name.lower()] == version.strip(), name
