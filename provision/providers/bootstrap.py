"""`runtime: bootstrap`: a Vast/RunPod node booted from a public vendor PyTorch image
(providers/vendor_images.py) gets the node side at first boot, before the doctor's checks: a venv
over the image's python with --system-site-packages (the image's torch is used, never
reinstalled), and in it the pins that the Dockerfile installs, the same images/requirements-*.txt
files. images/bootstrap.sh does it on the node; an image whose torch or CUDA is not the pinned one
is one error line naming both. The run bundle then ships as with every runtime."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from provision.core.errors import ProviderError
from provision.core.state import NodeRecord
from provision.transport.remote import Node

INSTALL_TIMEOUT_S = 1800.0  # DeepSpeed's sdist, transformers, boto3 (and torch where the image has none)
PIN_FILES = ("requirements-deepspeed.txt", "requirements-train.txt")
TORCH_INDEX = {"cpu": "https://download.pytorch.org/whl/cpu", "cuda": ""}  # as flows/build.py's flavours
ERROR_MARK = "gpuctl-bootstrap-error: "
PROGRESS_MARK = "gpuctl-bootstrap: "


def images_dir() -> Path:
    """images/ (pins, bootstrap.sh): inside the package in a wheel, beside it in a checkout."""
    package = Path(__file__).resolve().parents[1]
    wheel = package / "images"
    return wheel if wheel.is_dir() else package.parent / "images"


def pin_texts(flavour: str) -> dict[str, str]:
    """The pin files as the node gets them: the flavour's torch list as requirements-torch.txt."""
    here = images_dir()
    texts = {"requirements-torch.txt": (here / f"requirements-torch-{flavour}.txt").read_text()}
    texts.update({name: (here / name).read_text() for name in PIN_FILES})
    return texts


def venv_python(workdir: str) -> str:
    return f"{workdir.rstrip('/')}/venv/bin/python"


def flavour_of(node: NodeRecord) -> str:
    return "cuda" if node.accelerator == "cuda" else "cpu"


def install(ssh: Node, node: NodeRecord, base_python: str, say: Callable[[str], None]) -> str:
    """Install the node side on one node; returns the venv's python. A torch/CUDA mismatch or a
    failed install raises ProviderError (`up` then terminates what it rented)."""
    assert node.workdir is not None  # boot.probe set it
    flavour = flavour_of(node)
    pins = f"{node.workdir.rstrip('/')}/bootstrap/pins"
    for name, text in pin_texts(flavour).items():
        ssh.write_text(f"{pins}/{name}", text, mode="644")
    venv = venv_python(node.workdir).removesuffix("/bin/python")
    say(f"{node.host}: installing the node side ({flavour} pins) into {venv}")
    started = time.monotonic()
    errors: list[str] = []

    def line(text: str) -> None:
        if text.startswith(ERROR_MARK):
            errors.append(text.removeprefix(ERROR_MARK).strip())
        elif text.startswith(PROGRESS_MARK):
            say(f"{node.host}: {text.removeprefix(PROGRESS_MARK).strip()}")

    script = (images_dir() / "bootstrap.sh").read_text()
    args = (venv, pins, base_python, flavour, TORCH_INDEX[flavour])
    result = ssh.sh(script, *args, check=False, timeout=INSTALL_TIMEOUT_S, stream=line)
    if errors:
        raise ProviderError(
            f"{node.host}: {errors[0]}", "see provision/providers/vendor_images.py for the pinned image"
        )
    if result.rc != 0:
        tail = " | ".join((result.stderr.strip() or result.stdout.strip()).splitlines()[-3:])[-300:]
        raise ProviderError(
            f"{node.host}: the node-side install failed (exit {result.rc}): {tail}",
            "retry `gpuctl up`; or set provider.image to a prebuilt trainer image",
        )
    node.install_s = round(time.monotonic() - started, 1)
    say(f"{node.host}: node side ready in {node.install_s:.0f}s")
    return venv_python(node.workdir)
