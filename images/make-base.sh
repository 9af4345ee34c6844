#!/usr/bin/env bash
# A minimal Debian base image for the cpu flavour of the trainer image, made without a registry:
# debootstrap (variant minbase) from the Debian mirror, then `docker import` into the dockerd
# that DOCKER_HOST points at. Prints the image name (gpuctl-base:<suite>-<key>) on stdout.
#
#   DOCKER_HOST=unix:///path/docker.sock images/make-base.sh
#   docker build --build-arg BASE_IMAGE="$(images/make-base.sh)" ...   (gpuctl image build --flavour cpu --base ...)
#
# The rootfs tar is cached under $GPUCTL_CACHE_DIR/base/ (default ${XDG_CACHE_HOME:-~/.cache}/gpuctl)
# by a hash of its inputs: this script, the suite and the package list. A second run imports the
# cached tar (seconds); a dockerd that already has the image is left alone. Only the suite's main
# pocket is used, and the Dockerfile's `apt-get update` reads it: this base is for building and
# testing the cpu flavour, not for a long-lived production image.
# Needs root and debootstrap (apt-get install debootstrap), and the Debian archive keyring.
set -euo pipefail

SUITE=${GPUCTL_BASE_SUITE:-bookworm}
MIRROR=${GPUCTL_BASE_MIRROR:-http://deb.debian.org/debian}
CACHE=${GPUCTL_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/gpuctl}
# minbase has apt, dpkg and bash; the Dockerfile's apt layer installs the rest (python3, sshd, g++).
PACKAGES=(ca-certificates)

key=$({ cat "${BASH_SOURCE[0]}"; echo "$SUITE"; printf '%s\n' "${PACKAGES[@]}"; } | sha256sum | cut -c1-16)
image="gpuctl-base:$SUITE-$key"
dir="$CACHE/base"
tar="$dir/debian-$SUITE-$key.tar"
mkdir -p "$dir"

root=""
cleanup() {
  # debootstrap mounts proc/sys (and may bind /dev) inside the target: unmount before deleting
  if [ -n "$root" ] && [ -d "$root" ]; then
    awk -v r="$root/" 'index($2, r) == 1 { print $2 }' /proc/mounts | sort -r | while read -r mnt; do
      umount -l "$mnt" 2>/dev/null || true
    done
    rm -rf --one-file-system "$root"
  fi
  rm -f "$tar.tmp"
}
trap cleanup EXIT

exec 9>"$dir/.lock"
flock 9  # one debootstrap per cache at a time; a second caller waits, then finds the tar

if [ ! -s "$tar" ]; then
  command -v debootstrap >/dev/null || { echo "make-base.sh: needs debootstrap (apt-get install debootstrap)" >&2; exit 2; }
  [ "$(id -u)" = 0 ] || { echo "make-base.sh: debootstrap needs root" >&2; exit 2; }
  root=$(mktemp -d "$dir/rootfs.XXXXXX")
  started=$SECONDS
  echo "make-base.sh: debootstrap $SUITE from $MIRROR (once; cached as $tar)" >&2
  debootstrap --variant=minbase --include="$(IFS=,; echo "${PACKAGES[*]}")" "$SUITE" "$root" "$MIRROR" >&2
  # what a container never needs: downloaded .debs, package lists, logs, machine identity
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/var/log/* \
         "$root"/tmp/* "$root"/etc/machine-id "$root"/etc/hostname
  echo "deb $MIRROR $SUITE main" > "$root/etc/apt/sources.list"
  tar --numeric-owner --one-file-system -C "$root" -cf "$tar.tmp" .
  mv "$tar.tmp" "$tar"
  echo "make-base.sh: rootfs in $((SECONDS - started)) s, $(du -m "$tar" | cut -f1) MB" >&2
fi

if ! docker image inspect "$image" >/dev/null 2>&1; then
  docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["/bin/bash"]' \
    "$tar" "$image" >&2
fi
echo "$image"
