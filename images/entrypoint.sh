#!/usr/bin/env bash
# gpuctl trainer image entrypoint: publish the environment to SSH sessions, start sshd when the
# container is the node, then exec the command.
#
# Vast.ai and RunPod create the instance from this image: the container IS the node and needs its
# own sshd. The key comes in the variables the vendors use: PUBLIC_KEY (RunPod's account keys,
# the common convention) and SSH_PUBLIC_KEY (RunPod's per-pod key); each may hold several lines.
# sshd starts when either is set, or with GPUCTL_SSHD=1; GPUCTL_SSHD=0 never starts it. It listens
# on port GPUCTL_SSHD_PORT (22) of every address, or of GPUCTL_SSHD_LISTEN only (a container on
# a shared host network, as in the tests: 127.0.0.1).
# Under `docker run` (runtime docker) neither is set: the host has its own sshd.
# Host keys are generated here, at start, so no private key is ever baked into an image layer.
# Vast's SSH runtypes replace this entrypoint with a plain `sshd -D`: the session environment
# written at build time (gpuctl-session-env in the Dockerfile) covers that case.
set -euo pipefail

# The environment an SSH session sees: this container's, where sshd/PAM/login shells read it.
# Before sshd starts (it reads its config once). Best effort: a non-root user or a read-only
# /etc keeps what the build wrote.
if [ "$(id -u)" = 0 ] && [ -x /usr/local/sbin/gpuctl-session-env ]; then
  /usr/local/sbin/gpuctl-session-env || echo "gpuctl-entrypoint: could not update the SSH session environment" >&2
fi

want_sshd=0
case "${GPUCTL_SSHD:-}" in
  1) want_sshd=1 ;;
  0) want_sshd=0 ;;
  *) if [ -n "${PUBLIC_KEY:-}${SSH_PUBLIC_KEY:-}" ]; then want_sshd=1; fi ;;
esac

if [ "$want_sshd" = 1 ]; then
  mkdir -p /run/sshd /root/.ssh
  chmod 700 /root/.ssh
  keys=/root/.ssh/authorized_keys
  touch "$keys"
  chmod 600 "$keys"
  while IFS= read -r line; do
    line="${line%$'\r'}"
    if [ -n "$line" ] && ! grep -qxF -- "$line" "$keys"; then printf '%s\n' "$line" >> "$keys"; fi
  done <<< "${PUBLIC_KEY:-}"$'\n'"${SSH_PUBLIC_KEY:-}"
  ssh-keygen -A >/dev/null
  listen=()
  if [ -n "${GPUCTL_SSHD_LISTEN:-}" ]; then listen=(-o "ListenAddress=${GPUCTL_SSHD_LISTEN}"); fi
  /usr/sbin/sshd -p "${GPUCTL_SSHD_PORT:-22}" "${listen[@]}" \
    -o PasswordAuthentication=no -o PermitRootLogin=prohibit-password
fi

# A capped node's budget guards start again after a container restart (gpuctl's flows/guard.py,
# BOOT_HOOK in provision/providers/base.py): the boot hook `gpuctl up` wrote in the node's workdir.
# Nothing before `up` wrote one; a failing hook never stops the container from starting.
( h="${GPUCTL_WORKDIR:-${HOME:-/root}/gpuctl}/guard/boot.sh"; if [ -f "$h" ]; then bash "$h"; fi ) \
  || echo "gpuctl-entrypoint: the budget guard's boot hook failed" >&2

exec "$@"
