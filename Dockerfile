# gpuctl trainer image. One Dockerfile, two flavours; they differ only in the build args below
# (the base image, the torch wheel source and pin, the DeepSpeed accelerator and prebuilt ops),
# so building the cpu flavour runs every step the cuda flavour runs.
#   cuda (the defaults): CUDA 12.8 + cuDNN, torch 2.10 (cu128), DeepSpeed with CPU Adam and fused
#         Adam prebuilt for sm_80 (A100), sm_89 (RTX 4090), sm_90 (H100). What Vast.ai/RunPod boot.
#   cpu:  a Debian base, torch 2.13 (CPU build), DeepSpeed with CPU Adam and the shared-memory
#         allreduce prebuilt. What the tests build and run (images/make-base.sh makes the base).
# Both: transformers, boto3, sshd + pdsh for multi-node, tini, the trainer.
# Build: `gpuctl image build [--flavour cpu] [--push]` (provision/flows/build.py sets the args).
#
# Versions live in images/requirements-*.txt; the labels below repeat the shared ones and a test
# (tests/test_dockerfile.py) keeps the two in agreement.
#
# The cuda base is pinned by tag. For a byte-for-byte reproducible base, pin its digest too:
#   docker buildx imagetools inspect nvidia/cuda:12.8.1-cudnn-devel-ubuntu24.04   # prints sha256:...
#   --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-devel-ubuntu24.04@sha256:<that digest>
# CUDA 12.8 needs an NVIDIA driver >= 570 (>= 525 through CUDA minor-version compatibility,
# which covers the prebuilt SASS for the archs below).
ARG BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-devel-ubuntu24.04
FROM ${BASE_IMAGE}

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ARG DEBIAN_FRONTEND=noninteractive

# 1. System packages (change rarely): Python for the venv, g++ and headers for the op build (the
#    CUDA devel base has g++ already), sshd + pdsh for DeepSpeed's multi-node launcher, tini as
#    PID 1. The host keys apt generates are removed in the same layer; the entrypoint makes fresh
#    ones at start.
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      python3 python3-venv python3-dev g++ \
      openssh-server openssh-client pdsh \
      ca-certificates git tini libaio-dev \
 && rm -rf /var/lib/apt/lists/* /etc/ssh/ssh_host_* \
 && mkdir -p /run/sshd

ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1
# `python`/`python3` in /usr/local/bin exec the venv's, for a shell whose PATH was reset (sshd's
# default PATH has /usr/local/bin first). The session environment proper is written further down.
RUN python3 -m venv "$VIRTUAL_ENV" \
 && for exe in python python3; do \
      printf '#!/bin/sh\nexec %s/bin/%s "$@"\n' "$VIRTUAL_ENV" "$exe" > "/usr/local/bin/$exe"; \
      chmod 755 "/usr/local/bin/$exe"; \
    done

# 2. torch (the largest layer; changes only with images/requirements-torch-<flavour>.txt).
#    TORCH_INDEX_URL: where the flavour's wheel lives when PyPI does not have it (the cpu build).
#    BUILD_CA_CERTS: extra CAs for pip behind a TLS-intercepting proxy (images/build-ca.sh).
ARG FLAVOUR=cuda
ARG TORCH_INDEX_URL=""
ARG BUILD_CA_CERTS=""
COPY images/build-ca.sh /opt/gpuctl/build/
COPY images/requirements-torch-${FLAVOUR}.txt /opt/gpuctl/requirements/requirements-torch.txt
RUN . /opt/gpuctl/build/build-ca.sh \
 && pip install ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} \
      -r /opt/gpuctl/requirements/requirements-torch.txt

# 3. DeepSpeed with its ops compiled now, not JIT on the node. There is no GPU during a build:
#    DS_ACCELERATOR=cuda and TORCH_CUDA_ARCH_LIST make it compile for the listed archs anyway.
#    PREBUILD_OPS names DeepSpeed's DS_BUILD_<OP> switches to turn on; check-ds-ops.py fails the
#    build if one was skipped. CPU ops would be built for THIS machine's CPU (-march=native): the
#    CXX wrapper pins them to CPU_ARCH so the image runs on any host (images/portable-cxx.sh says why).
#    (SC3054 warns about arrays in POSIX sh; the SHELL above is bash.)
ARG DS_ACCELERATOR=cuda
ARG PREBUILD_OPS="CPU_ADAM FUSED_ADAM"
ARG TORCH_CUDA_ARCH_LIST="8.0;8.9;9.0"
ARG CPU_ARCH=x86-64-v3
ARG MAX_JOBS=4
COPY images/portable-cxx.sh /opt/gpuctl/cc/g++
COPY images/check-ds-ops.py /opt/gpuctl/build/
COPY images/requirements-deepspeed.txt /opt/gpuctl/requirements/
# hadolint ignore=SC3054
RUN . /opt/gpuctl/build/build-ca.sh \
 && read -ra ops <<< "$PREBUILD_OPS" \
 && for op in "${ops[@]}"; do export "DS_BUILD_${op}=1"; done \
 && TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST}" MAX_JOBS="${MAX_JOBS}" \
    CXX=/opt/gpuctl/cc/g++ GPUCTL_CPU_ARCH="${CPU_ARCH}" \
    pip install --no-build-isolation \
      -c /opt/gpuctl/requirements/requirements-torch.txt \
      -r /opt/gpuctl/requirements/requirements-deepspeed.txt \
 && python /opt/gpuctl/build/check-ds-ops.py "${ops[@]}"

# 4. The trainer's other Python dependencies; earlier pins are constraints, so nothing moves.
COPY images/requirements-train.txt /opt/gpuctl/requirements/
RUN . /opt/gpuctl/build/build-ca.sh \
 && pip install \
      -c /opt/gpuctl/requirements/requirements-torch.txt \
      -c /opt/gpuctl/requirements/requirements-deepspeed.txt \
      -r /opt/gpuctl/requirements/requirements-train.txt

# 5. The node's environment and entrypoint. TINI_SUBREAPER: under `docker run --init` (runtime
#    docker) our tini is not PID 1; it still reaps. gpuctl-session-env writes this environment
#    where an SSH session reads it (sshd SetEnv, /etc/environment, /etc/profile.d): a vendor that
#    replaces the entrypoint with a plain `sshd -D` still gives sessions the venv and DS_ACCELERATOR.
ENV PYTHONPATH=/opt/gpuctl \
    DS_ACCELERATOR=${DS_ACCELERATOR} \
    TINI_SUBREAPER=1
COPY images/session-env.py /usr/local/sbin/gpuctl-session-env
COPY images/entrypoint.sh /usr/local/bin/gpuctl-entrypoint
RUN /usr/local/sbin/gpuctl-session-env
WORKDIR /workspace
ENTRYPOINT ["/usr/bin/tini", "--", "/usr/local/bin/gpuctl-entrypoint"]
CMD ["sleep", "infinity"]

# 6. Our own code last: editing the trainer rebuilds only this layer (the labels after it are
#    metadata, not a layer; they carry the revision, which changes with every commit).
COPY trainer/ /opt/gpuctl/trainer/

ARG BASE_IMAGE
ARG GPUCTL_VERSION=0.1.0
ARG VCS_REF=unknown
LABEL org.opencontainers.image.title="gpuctl-trainer" \
      org.opencontainers.image.description="torch + DeepSpeed (ops prebuilt) + the gpuctl trainer, ${FLAVOUR} flavour" \
      org.opencontainers.image.version="${GPUCTL_VERSION}" \
      org.opencontainers.image.revision="${VCS_REF}" \
      org.opencontainers.image.source="https://github.com/gpuctl/gpuctl" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="${BASE_IMAGE}" \
      org.gpuctl.flavour="${FLAVOUR}" \
      org.gpuctl.deepspeed="0.19.8" \
      org.gpuctl.deepspeed-ops="${PREBUILD_OPS}" \
      org.gpuctl.transformers="5.24.0" \
      org.gpuctl.cuda-arch-list="${TORCH_CUDA_ARCH_LIST}" \
      org.gpuctl.cpu-arch="${CPU_ARCH}"
