#!/usr/bin/env bash
# gpuctl trainer image entrypoint: start sshd when asked, then exec the command.
#
# Vast.ai and RunPod create the instance from this image, so the container IS the node and
# needs its own sshd: set GPUCTL_SSHD=1 (RunPod's PUBLIC_KEY is added to authorized_keys).
# Host keys are generated here, at start, so no private key is ever baked into an image layer.
# Under `docker run` (runtime docker) nothing of this runs: the host has its own sshd.
set -euo pipefail

if [ "${GPUCTL_SSHD:-0}" = 1 ]; then
  mkdir -p /run/sshd /root/.ssh
  chmod 700 /root/.ssh
  if [ -n "${PUBLIC_KEY:-}" ]; then
    printf '%s\n' "$PUBLIC_KEY" >> /root/.ssh/authorized_keys
    chmod 600 /root/.ssh/authorized_keys
  fi
  ssh-keygen -A >/dev/null
  /usr/sbin/sshd -p "${GPUCTL_SSHD_PORT:-22}" -o PasswordAuthentication=no -o PermitRootLogin=prohibit-password
fi

exec "$@"
