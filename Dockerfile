# gpuctl trainer image: CUDA 12.8 + cuDNN, torch 2.10 (cu128), DeepSpeed with CPU Adam and
# fused Adam prebuilt for sm_80 (A100), sm_89 (RTX 4090), sm_90 (H100), transformers, boto3,
# sshd + pdsh for multi-node, and the trainer.  Build: `gpuctl image build [--push]`.
#
# Versions live in images/requirements-*.txt; the labels below repeat them and a test
# (tests/test_dockerfile.py) keeps the two in agreement.
#
# The base is pinned by tag. For a byte-for-byte reproducible base, pin its digest too:
#   docker buildx imagetools inspect nvidia/cuda:12.8.1-cudnn-devel-ubuntu24.04   # prints sha256:...
#   FROM nvidia/cuda:12.8.1-cudnn-devel-ubuntu24.04@sha256:<that digest>
# CUDA 12.8 needs an NVIDIA driver >= 570 (>= 525 through CUDA minor-version compatibility,
# which covers the prebuilt SASS for the archs below).
FROM nvidia/cuda:12.8.1-cudnn-devel-ubuntu24.04

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ARG DEBIAN_FRONTEND=noninteractive

# 1. System packages (change rarely): Python for the venv, compilers' headers for the op build,
#    sshd + pdsh for DeepSpeed's multi-node launcher, tini as PID 1. The host keys apt generates
#    are removed in the same layer; the entrypoint makes fresh ones at start.
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      python3 python3-venv python3-dev \
      openssh-server openssh-client pdsh \
      ca-certificates git tini libaio-dev \
 && rm -rf /var/lib/apt/lists/* /etc/ssh/ssh_host_* \
 && mkdir -p /run/sshd

ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1
# An SSH session into a Vast/RunPod instance (runtime image) does not see this ENV: sshd starts
# it with a default PATH. So `python`/`python3` in /usr/local/bin (first on that PATH) exec the
# venv's, and /etc/environment (read by PAM) puts the venv first for logins too.
RUN python3 -m venv "$VIRTUAL_ENV" \
 && for exe in python python3; do \
      printf '#!/bin/sh\nexec %s/bin/%s "$@"\n' "$VIRTUAL_ENV" "$exe" > "/usr/local/bin/$exe"; \
      chmod 755 "/usr/local/bin/$exe"; \
    done \
 && echo "PATH=\"$PATH\"" > /etc/environment

# 2. torch, the CUDA 12.8 build (the largest layer; changes only with images/requirements-torch.txt).
COPY images/requirements-torch.txt /opt/gpuctl/requirements/
RUN pip install -r /opt/gpuctl/requirements/requirements-torch.txt

# 3. DeepSpeed with its ops compiled now, not JIT on the node. There is no GPU during a build:
#    DS_ACCELERATOR=cuda and TORCH_CUDA_ARCH_LIST make it compile for the listed archs anyway.
#    CPU Adam would be built for THIS machine's CPU (-march=native): the CXX wrapper pins it to
#    GPUCTL_CPU_ARCH so the image runs on any GPU host (images/portable-cxx.sh says why).
ARG TORCH_CUDA_ARCH_LIST="8.0;8.9;9.0"
ARG GPUCTL_CPU_ARCH=x86-64-v3
ARG MAX_JOBS=4
COPY images/portable-cxx.sh /opt/gpuctl/cc/g++
COPY images/requirements-deepspeed.txt /opt/gpuctl/requirements/
RUN DS_ACCELERATOR=cuda DS_BUILD_CPU_ADAM=1 DS_BUILD_FUSED_ADAM=1 \
    TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST}" MAX_JOBS="${MAX_JOBS}" \
    CXX=/opt/gpuctl/cc/g++ GPUCTL_CPU_ARCH="${GPUCTL_CPU_ARCH}" \
    pip install --no-build-isolation \
      -c /opt/gpuctl/requirements/requirements-torch.txt \
      -r /opt/gpuctl/requirements/requirements-deepspeed.txt \
 && DS_ACCELERATOR=cuda python -c "import deepspeed.git_version_info as v; \
      missing = [op for op in ('cpu_adam', 'fused_adam') if not v.installed_ops.get(op)]; \
      assert not missing, f'DeepSpeed ops not prebuilt: {missing}'"

# 4. The trainer's other Python dependencies; earlier pins are constraints, so nothing moves.
COPY images/requirements-train.txt /opt/gpuctl/requirements/
RUN pip install \
      -c /opt/gpuctl/requirements/requirements-torch.txt \
      -c /opt/gpuctl/requirements/requirements-deepspeed.txt \
      -r /opt/gpuctl/requirements/requirements-train.txt

# 5. Our own code last: editing the trainer rebuilds only these small layers.
COPY images/entrypoint.sh /usr/local/bin/gpuctl-entrypoint
COPY trainer/ /opt/gpuctl/trainer/
# TINI_SUBREAPER: under `docker run --init` (runtime docker) our tini is not PID 1; it still reaps.
ENV PYTHONPATH=/opt/gpuctl \
    DS_ACCELERATOR=cuda \
    TINI_SUBREAPER=1

ARG GPUCTL_VERSION=0.1.0
ARG VCS_REF=unknown
LABEL org.opencontainers.image.title="gpuctl-trainer" \
      org.opencontainers.image.description="CUDA 12.8 + torch + DeepSpeed (CPU/fused Adam prebuilt) + the gpuctl trainer" \
      org.opencontainers.image.version="${GPUCTL_VERSION}" \
      org.opencontainers.image.revision="${VCS_REF}" \
      org.opencontainers.image.source="https://github.com/gpuctl/gpuctl" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="docker.io/nvidia/cuda:12.8.1-cudnn-devel-ubuntu24.04" \
      org.gpuctl.cuda="12.8.1" \
      org.gpuctl.torch="2.10.0" \
      org.gpuctl.deepspeed="0.19.8" \
      org.gpuctl.transformers="5.24.0" \
      org.gpuctl.cuda-arch-list="8.0;8.9;9.0" \
      org.gpuctl.cpu-arch="x86-64-v3"

WORKDIR /workspace
ENTRYPOINT ["/usr/bin/tini", "--", "/usr/local/bin/gpuctl-entrypoint"]
CMD ["sleep", "infinity"]
