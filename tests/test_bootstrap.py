"""runtime bootstrap: the default on vast/runpod without provider.image; the vendor image pinned in
one place and sent in the create call; the node-side install (images/bootstrap.sh, run for real
on this machine) over an image's torch, its one-line error on a torch/CUDA mismatch."""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from provision.core.config import GpuctlConfig
from provision.core.errors import ProviderError
from provision.core.state import ClusterRecord, NodeRecord
from provision.providers import bootstrap, runpod, vast
from provision.providers.base import Offer
from provision.providers.vendor_images import BOOTSTRAP_IMAGES, RUNPOD_START, TORCH_IMAGE
from provision.transport.remote import LocalNode

REPO = Path(__file__).resolve().parents[1]


def test_the_vendor_images_carry_the_pinned_torch_and_cuda():
    """The tag names the torch and CUDA that images/requirements-torch-cuda.txt pins."""
    pins = (REPO / "images" / "requirements-torch-cuda.txt").read_text()
    torch = re.search(r"^torch==([\d.]+)$", pins, re.M)
    cuda = re.search(r"^# cuda: ([\d.]+)$", pins, re.M)
    assert torch and cuda
    for image in BOOTSTRAP_IMAGES.values():
        assert image == TORCH_IMAGE == f"pytorch/pytorch:{torch[1]}-cuda{cuda[1]}-cudnn9-devel"
    assert set(BOOTSTRAP_IMAGES) == {"vast", "runpod"}


def test_init_leaves_the_image_unset_and_up_boots_the_vendor_image(tmp_path):
    from provision.flows.cluster import planned
    from provision.flows.init_config import config_text

    for kind in ("vast", "runpod"):
        (tmp_path / "gpuctl.yaml").write_text(config_text(kind, "s3://b/runs"))
        from provision.core.config import load_config

        cfg = load_config(tmp_path / "gpuctl.yaml")
        assert cfg.provider.image is None
        rec = planned(cfg)
        assert (rec.runtime, rec.image, rec.python) == ("bootstrap", TORCH_IMAGE, "/root/gpuctl/venv/bin/python")
    aws = GpuctlConfig.model_validate({"provider": {"kind": "aws"}})
    assert planned(aws).runtime == "docker" and aws.provider.image.endswith(":0.1.0")


def test_vast_creates_from_the_pinned_image_and_runpod_starts_sshd_in_it():
    prov = GpuctlConfig.model_validate({"provider": {"kind": "vast"}}).provider
    rec = ClusterRecord(name="c", provider="vast", nodes=[])
    assert vast.create_body(prov, rec, "lbl")["image"] == TORCH_IMAGE
    prov.image = "reg.example/own:1"
    assert vast.create_body(prov, rec, "lbl")["image"] == "reg.example/own:1"
    # RunPod's start command: sshd with the pod's keys, the boot hook, sshd as the main process
    assert "SSH_PUBLIC_KEY" in RUNPOD_START and RUNPOD_START.rstrip("'").endswith("exec /usr/sbin/sshd -D -e")
    assert subprocess.run(["bash", "-n", "-c", RUNPOD_START.removeprefix("bash -c ")], check=False).returncode == 0


def test_runpod_deploy_carries_the_image_and_start_command(monkeypatch):
    sent: list[dict] = []
    monkeypatch.setattr(runpod, "api", lambda url: None)
    monkeypatch.setattr(
        runpod,
        "gql",
        lambda client, q, variables, idempotent=True: (
            sent.append(variables) or {"podFindAndDeployOnDemand": {"id": "p1"}}
        ),
    )
    prov = GpuctlConfig.model_validate({"provider": {"kind": "runpod"}}).provider
    offer = Offer(id="COMMUNITY", gpu_name="4090", num_gpus=3, price_per_hour=1.0)
    rec = ClusterRecord(name="c", provider="runpod", nodes=[])
    assert runpod.BACKEND.launch(prov, rec, "lbl", offer, "ssh-ed25519 AAA") == "p1"
    pod = sent[0]["input"]
    assert pod["imageName"] == TORCH_IMAGE and pod["dockerArgs"] == RUNPOD_START
    prov.image = "reg.example/own:1"  # our image starts its own sshd: no start command
    runpod.BACKEND.launch(prov, rec, "lbl", offer, "ssh-ed25519 AAA")
    assert sent[1]["input"]["imageName"] == "reg.example/own:1" and "dockerArgs" not in sent[1]["input"]


def node(tmp_path: Path, accelerator: str) -> NodeRecord:
    return NodeRecord(host="n0", accelerator=accelerator, workdir=str(tmp_path / "node"))


def test_an_image_whose_torch_is_not_the_pin_fails_in_one_line(tmp_path):
    """This venv's torch (2.13 CPU build) on a CUDA node: the cuda pins want 2.10.0 with CUDA 12.8."""
    said: list[str] = []
    with pytest.raises(ProviderError) as err:
        bootstrap.install(LocalNode(), node(tmp_path, "cuda"), sys.executable, said.append)
    msg = err.value.message
    assert "\n" not in msg
    assert "torch 2.13.0+cpu (CUDA none)" in msg and "pinned torch 2.10.0 (CUDA 12.8)" in msg, msg
    assert not (tmp_path / "node" / "venv").exists()  # nothing half-made is left to be taken for ready


def pip_cache() -> Path:
    """pip's downloads kept between runs on this machine, keyed by the pin files."""
    pins = b"".join(p.read_bytes() for p in sorted((REPO / "images").glob("requirements-*.txt")))
    return Path.home() / ".cache" / "gpuctl" / f"pip-{hashlib.sha256(pins).hexdigest()[:16]}"


def test_the_node_side_installs_over_the_image_torch_into_a_venv(tmp_path, monkeypatch):
    """This venv stands in for the image's python (torch 2.13.0+cpu = the cpu pin): the install makes
    a venv over it, takes its torch and DeepSpeed as they are and puts the pins' versions of the rest
    in the venv (this venv's transformers is not the pinned one), then a second call keeps it."""
    monkeypatch.setenv("PIP_CACHE_DIR", str(pip_cache()))
    said: list[str] = []
    n = node(tmp_path, "cpu")
    python = bootstrap.install(LocalNode(), n, sys.executable, said.append)
    assert python == str(tmp_path / "node" / "venv" / "bin" / "python")
    probe = (
        "import torch, deepspeed, transformers, boto3, sys; "
        "print(torch.__version__, deepspeed.__version__, transformers.__version__, boto3.__version__, "
        "torch.__file__.startswith(sys.prefix), transformers.__file__.startswith(sys.prefix))"
    )
    out = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=300, check=True).stdout
    pins = "".join((REPO / "images" / f).read_text() for f in ("requirements-train.txt", "requirements-deepspeed.txt"))
    want = {k: re.search(rf"^{k}==(\S+)$", pins, re.M)[1] for k in ("deepspeed", "transformers", "boto3")}  # type: ignore[index]
    assert out.splitlines()[-1].split() == [
        "2.13.0+cpu",
        want["deepspeed"],
        want["transformers"],
        want["boto3"],
        "False",
        "True",
    ]
    assert any("is the pinned one" in line for line in said) and n.install_s is not None
    started = time.monotonic()
    again: list[str] = []
    assert bootstrap.install(LocalNode(), n, sys.executable, again.append) == python
    assert any("already installed" in line for line in again) and time.monotonic() - started < 30
