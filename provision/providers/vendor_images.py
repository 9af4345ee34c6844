"""The public PyTorch image a Vast/RunPod node boots under `runtime: bootstrap` (provider.image unset),
one per vendor, pinned by tag here and nowhere else. Its torch must be the torch that
images/requirements-torch-cuda.txt pins (the node checks: providers/bootstrap.py), so moving that pin
means moving these tags.

- vast: `pytorch/pytorch:2.10.0-cuda12.8-cudnn9-devel`, PyTorch's own image on Docker Hub (the base
  of Vast's "PyTorch (cuDNN Devel)" template family): torch 2.10.0+cu128 in /opt/conda, with nvcc (the
  devel flavour) for DeepSpeed's JIT op builds. Vast's SSH runtype brings its own sshd into any
  image, and our ONSTART writes the image's ENV (PATH to /opt/conda/bin) to /etc/environment.
- runpod: the same image. RunPod's own `runpod/pytorch` line has no torch 2.10 tag that we could
  find (newest seen: runpod/pytorch:1.0.3-cu1281-torch291-ubuntu2404, torch 2.9.1), and that image
  is the one piece that would differ; pytorch/pytorch has no sshd, so the pod's start command
  (RUNPOD_START below, RunPod's `dockerArgs`) installs and starts one with the pod's keys, as
  RunPod's own images do from PUBLIC_KEY/SSH_PUBLIC_KEY.
"""

from __future__ import annotations

from provision.core.provider_config import CloudProvider
from provision.providers.base import BOOT_HOOK

TORCH_IMAGE = "pytorch/pytorch:2.10.0-cuda12.8-cudnn9-devel"
BOOTSTRAP_IMAGES = {"vast": TORCH_IMAGE, "runpod": TORCH_IMAGE}
# Compressed size (GB, the bytes a pull downloads) of each pinned image, with its source: `up`'s
# first-step estimate (provision/estimate/startup.py) counts the pull from it. Moving a tag above means
# moving its figure here (tests/test_startup_estimate.py checks every pinned image has one).
IMAGE_SIZES: dict[str, tuple[float, str]] = {
    TORCH_IMAGE: (
        10.0,
        "assumed, not read for this tag: Docker Hub lists 9-11 GB compressed for the earlier "
        "pytorch/pytorch *-cuda12.x-cudnn9-devel tags (CUDA devel toolkit + cuDNN + torch in conda); "
        "Docker Hub was not reachable from where this was written. Check: sum the layer sizes of "
        "`docker manifest inspect -v` for the tag",
    ),
}

# RunPod's container start command for an image without sshd: the image's environment into
# /etc/environment (SSH sessions see /opt/conda/bin first, as Vast's ONSTART does), then sshd on
# 22 with RunPod's account key (PUBLIC_KEY) and the pod's own (SSH_PUBLIC_KEY), in the foreground
# as the container's main process; the budget guards' boot hook first (as images/entrypoint.sh runs it). Secret-looking names stay out of the world-readable file.
RUNPOD_START = r"""bash -c 'set -e
command -v sshd >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends openssh-server >/dev/null; }
mkdir -p /run/sshd /root/.ssh && chmod 700 /root/.ssh
printf "%s\n%s\n" "${PUBLIC_KEY:-}" "${SSH_PUBLIC_KEY:-}" | grep . >> /root/.ssh/authorized_keys || true
chmod 600 /root/.ssh/authorized_keys
env | grep -E "^[A-Za-z_][A-Za-z0-9_]*=" | grep -vE "^(HOME|PWD|SHLVL|_|HOSTNAME|TERM)=" | grep -viE "^[^=]*(KEY|TOKEN|SECRET|PASSW)[^=]*=" > /etc/environment || true
ssh-keygen -A >/dev/null
(BOOT_HOOK) || true
exec /usr/sbin/sshd -D -e'""".replace("BOOT_HOOK", BOOT_HOOK)


def boot_image(prov: CloudProvider, kind: str) -> str:
    """The image the instance is created from: provider.image, else the vendor's pinned PyTorch image."""
    return prov.image or BOOTSTRAP_IMAGES[kind]
