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
from typing import NamedTuple

from provision.core.errors import ProviderError
from provision.core.state import ClusterRecord, NodeRecord
from provision.transport.remote import Node, after_setup

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
    venv, pins = write_pins(ssh, node.workdir, flavour)
    say(f"{node.host}: installing the node side ({flavour} pins) into {venv}")
    started = time.monotonic()
    script = (images_dir() / "bootstrap.sh").read_text()
    argv = ["bash", "-c", script, "gpuctl", venv, pins, base_python, flavour, TORCH_INDEX[flavour]]
    failed = run_install(ssh, argv, node.host, say)
    if failed and failed.mismatch:
        raise ProviderError(
            f"{node.host}: {failed.text}", "see provision/providers/vendor_images.py for the pinned image"
        )
    if failed:
        raise ProviderError(
            f"{node.host}: the node-side install failed ({failed.text})",
            "retry `gpuctl up`; or set provider.image to a prebuilt trainer image",
        )
    node.install_s = round(time.monotonic() - started, 1)
    say(f"{node.host}: node side ready in {node.install_s:.0f}s")
    return venv_python(node.workdir)


def install_on_slurm(login: Node, cluster: ClusterRecord, say: Callable[[str], None]) -> str:
    """provider slurm, runtime bootstrap: the node side into <workdir>/venv on the shared filesystem, built
    once (kept while the pins are the same) by a short job on a compute node, over provider.python after
    provider.setup: the nodes' own Python and modules, not the login node's. Returns the venv's python."""
    prov, flavour = cluster.slurm, flavour_of(cluster.nodes[0])
    assert prov is not None  # provider slurm's record
    venv, pins = write_pins(login, prov.workdir, flavour)
    script = f"{prov.workdir.rstrip('/')}/bootstrap/bootstrap.sh"
    login.write_text(script, (images_dir() / "bootstrap.sh").read_text(), mode="644")
    inner = after_setup(prov.setup, ["bash", script, venv, pins, prov.python, flavour, TORCH_INDEX[flavour]])
    say(f"slurm: installing the node side ({flavour} pins) into {venv} in a job on the partition")
    started = time.monotonic()
    failed = run_install(login, login.on_compute(inner, INSTALL_TIMEOUT_S, name="bootstrap"), "slurm", say)
    if failed and failed.mismatch:
        raise ProviderError(
            f"slurm: {failed.text}",
            "set provider.python (or provider.setup) to a Python whose torch is the pinned one, or to one without torch",
        )
    if failed:
        raise ProviderError(
            f"slurm: the node-side install job failed ({failed.text})",
            "retry `gpuctl up` (on a full partition the job gets no node within 60 s); where the compute nodes "
            "cannot reach the package index, build the environment yourself and keep runtime: none",
        )
    say(f"slurm: node side ready in {time.monotonic() - started:.0f}s")
    return venv_python(prov.workdir)


def write_pins(ssh: Node, workdir: str, flavour: str) -> tuple[str, str]:
    """The flavour's pin files into <workdir>/bootstrap/pins; (the venv's folder, the pins' folder)."""
    pins = f"{workdir.rstrip('/')}/bootstrap/pins"
    for name, text in pin_texts(flavour).items():
        ssh.write_text(f"{pins}/{name}", text, mode="644")
    return venv_python(workdir).removesuffix("/bin/python"), pins


class InstallFailure(NamedTuple):
    mismatch: bool  # bootstrap.sh's own error line (the base's torch or python), else a failed exit
    text: str


def run_install(ssh: Node, argv: list[str], where: str, say: Callable[[str], None]) -> InstallFailure | None:
    """Run images/bootstrap.sh (argv) through ssh, its progress lines to say; how it failed, None when it did not."""
    errors: list[str] = []

    def line(text: str) -> None:
        if text.startswith(ERROR_MARK):
            errors.append(text.removeprefix(ERROR_MARK).strip())
        elif text.startswith(PROGRESS_MARK):
            say(f"{where}: {text.removeprefix(PROGRESS_MARK).strip()}")

    result = ssh.run(argv, check=False, timeout=INSTALL_TIMEOUT_S + 120, stream=line)
    if errors:
        return InstallFailure(True, errors[0])
    if result.rc != 0:
        tail = " | ".join((result.stderr.strip() or result.stdout.strip()).splitlines()[-3:])[-300:]
        return InstallFailure(False, f"exit {result.rc}: {tail}")
    return None
