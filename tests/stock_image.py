"""A stock PyTorch image for the runtime-bootstrap bench (tests/test_bootstrap_e2e.py): no gpuctl
layer in it, what a vendor's PyTorch image is to a node booted under `runtime: bootstrap`.

- ``stock_image``: images/make-base.sh's debootstrap base + Debian's python3, pip, venv, headers and
  g++ (the pytorch/pytorch devel image has a compiler for DeepSpeed's JIT ops), + torch's CPU wheel
  from the loopback index of tests/trainer_image.py (the vendor image ships torch; pip reaches PyPI
  for torch's own dependencies with this machine's extra CAs, as the trainer image build does).
  No sshd: RunPod's start command installs one (provider's RUNPOD_START).
- ``with_sshd``: the same plus openssh-server, standing in for the sshd that Vast's SSH runtype
  brings into any image.

Both are tagged by a hash of their inputs (this file's Dockerfiles, the base, the torch wheel) and
kept in the image engine's persistent data root: an unchanged image is found, not rebuilt.
``node_network``: what a container needs to reach the package index as this machine does, as
``docker run`` arguments: the CA bundle and a pip.conf naming it and a pip cache kept under the
cache dir (keyed by the stock image and the pin files), so a second node downloads nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import ssl
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.dockerd import Dockerd
from tests.helpers import REPO
from tests.trainer_image import cache_dir, extra_ca_certs, make_base, torch_pin, torch_wheel, wheel_index

STOCK = """\
ARG BASE_IMAGE
FROM ${BASE_IMAGE}
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ARG DEBIAN_FRONTEND=noninteractive
RUN apt-get update \\
 && apt-get install -y --no-install-recommends python3 python3-pip python3-venv python3-dev g++ \\
 && rm -rf /var/lib/apt/lists/*
ARG TORCH_INDEX_URL
ARG TORCH_PIN
ARG BUILD_CA_CERTS=""
COPY build-ca.sh /tmp/build-ca.sh
RUN . /tmp/build-ca.sh \\
 && pip install --no-cache-dir --break-system-packages --extra-index-url "$TORCH_INDEX_URL" "torch==$TORCH_PIN" \\
 && rm /tmp/build-ca.sh
CMD ["sleep", "infinity"]
"""
SSHD = """\
ARG STOCK
FROM ${STOCK}
RUN apt-get update \\
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends openssh-server \\
 && rm -rf /var/lib/apt/lists/* /etc/ssh/ssh_host_*
"""
PIP_CACHE = "/var/cache/gpuctl-pip"  # in the container


@dataclass
class StockImage:
    name: str  # no sshd (RunPod installs one at start)
    with_sshd: str  # + openssh-server (Vast's SSH runtype brings its own)
    engine: Dockerd
    seconds: float  # this session's build (or find)
    key: str


def _key(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _build(engine: Dockerd, tag: str, dockerfile: str, args: dict[str, str], files: dict[str, Path]) -> None:
    if engine.docker("image", "inspect", tag, check=False).returncode == 0:
        return
    with tempfile.TemporaryDirectory() as ctx:
        Path(ctx, "Dockerfile").write_text(dockerfile)
        for name, src in files.items():
            shutil.copy(src, Path(ctx, name))
        argv = [a for k, v in args.items() for a in ("--build-arg", f"{k}={v}")]
        engine.docker("build", "-q", "--network", "host", "-t", tag, *argv, ctx, timeout=1800)


@pytest.fixture(scope="session")
def stock_image(image_engine) -> StockImage:
    started = time.monotonic()
    base, wheel = make_base(image_engine), torch_wheel()
    key = _key(STOCK, base, wheel.name)
    name, sshd = f"gpuctl-stock:{key}", f"gpuctl-stock:{_key(key, SSHD)}-sshd"
    with contextlib.ExitStack() as stack:
        if image_engine.docker("image", "inspect", name, check=False).returncode != 0:
            index = os.environ.get("GPUCTL_TORCH_INDEX_URL") or stack.enter_context(wheel_index(wheel))
            args = {"BASE_IMAGE": base, "TORCH_INDEX_URL": index, "TORCH_PIN": torch_pin()}
            if pem := extra_ca_certs():
                args["BUILD_CA_CERTS"] = pem
            _build(image_engine, name, STOCK, args, {"build-ca.sh": REPO / "images" / "build-ca.sh"})
    _build(image_engine, sshd, SSHD, {"STOCK": name}, {})
    return StockImage(name, sshd, image_engine, time.monotonic() - started, key)


def pip_cache(image: StockImage) -> Path:
    """pip's downloads and built wheels for this image's python and these pins, kept between runs."""
    pins = b"".join(p.read_bytes() for p in sorted((REPO / "images").glob("requirements-*.txt")))
    path = cache_dir() / f"pip-stock-{_key(image.key, hashlib.sha256(pins).hexdigest())}"
    path.mkdir(exist_ok=True)
    return path


def node_network(image: StockImage, folder: Path) -> list[str]:
    """`docker run` mounts that let a container's pip reach the index as this machine does: this
    machine's CA bundle (its extra CAs included) and a pip.conf naming it and the shared pip cache."""
    bundle = os.environ.get("PIP_CERT") or os.environ.get("SSL_CERT_FILE") or ssl.get_default_verify_paths().cafile
    conf = folder / "pip.conf"
    conf.write_text(f"[global]\ncert = /etc/gpuctl-test-ca.pem\ncache-dir = {PIP_CACHE}\n")
    return [
        *("-v", f"{conf}:/etc/pip.conf:ro"),
        *("-v", f"{bundle}:/etc/gpuctl-test-ca.pem:ro"),
        *("-v", f"{pip_cache(image)}:{PIP_CACHE}"),
    ]
