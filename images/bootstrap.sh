#!/usr/bin/env bash
# runtime bootstrap: the node side installed over a vendor PyTorch image (provision/providers/bootstrap.py
# runs this over SSH). A venv with --system-site-packages over the image's python, so the image's
# torch (CUDA build, ~2-5 GB) is used as it is; the pins (the same images/requirements-*.txt the
# Dockerfile installs) go into the venv. Idempotent: a venv made from the same pins is kept.
# Args: VENV PINS_DIR BASE_PYTHON FLAVOUR(cuda|cpu) TORCH_INDEX_URL(may be empty)
# Output: progress lines; a mismatch is one line "gpuctl-bootstrap-error: ..." and exit 3.
set -euo pipefail
venv=$1 pins=$2 base=$3 flavour=$4 index=$5
fail() { echo "gpuctl-bootstrap-error: $*"; exit 3; }
command -v "$base" >/dev/null 2>&1 || fail "the image has no $base (provider.python); pick an image with Python 3"
stamp=$(cat "$pins"/requirements-*.txt | sha256sum | cut -c1-16)
if [ -f "$venv/.gpuctl-pins" ] && [ "$(cat "$venv/.gpuctl-pins")" = "$stamp" ]; then
  echo "gpuctl-bootstrap: node side already installed ($venv, pins $stamp)"; exit 0
fi
# The image's torch against the pin: a wrong one is an error now, not a 2 GB reinstall or a
# DeepSpeed build against the wrong headers later.
want=$(sed -n 's/^torch==\([^ ]*\).*/\1/p' "$pins/requirements-torch.txt")
want_cuda=$(sed -n 's/^# cuda: \([0-9.]*\).*/\1/p' "$pins/requirements-torch.txt")
have=$("$base" -c 'import torch; print(torch.__version__, torch.version.cuda or "none")' 2>/dev/null || true)
if [ -n "$have" ]; then
  set -- $have
  have_cuda=$(echo "$2" | cut -d. -f1,2)
  if [ "${1%%+*}" != "${want%%+*}" ] || { [ -n "$want_cuda" ] && [ "$have_cuda" != "$want_cuda" ]; }; then
    fail "the image's torch $1 (CUDA $2) is not the pinned torch $want${want_cuda:+ (CUDA $want_cuda)} of images/requirements-torch-$flavour.txt; set provider.image to an image with that torch, or move the pin"
  fi
  echo "gpuctl-bootstrap: the image's torch $1 (CUDA $2) is the pinned one"
  index=""  # torch's own index serves only torch: the rest comes from PyPI, no lookups where it is unreachable
else
  echo "gpuctl-bootstrap: the image has no torch: installing torch $want from the package index"
fi
rm -rf "$venv"
"$base" -m venv --system-site-packages "$venv" || fail "$base -m venv failed (the image needs python3-venv)"
# The base's own site dirs too, when the base is itself a venv (--system-site-packages reaches
# only the interpreter it was made from).
purelib=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$base" -c 'import site, sys; print("\n".join(p for p in site.getsitepackages() + [site.getusersitepackages()] if p))' > "$purelib/gpuctl-image-site.pth"
# The Dockerfile's three steps and constraints: DeepSpeed's sdist imports torch to build (no
# isolation); its ops are not prebuilt here but JIT-built at the first run (the op cache keeps them).
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
"${pip[@]}" ${index:+--extra-index-url "$index"} -r "$pins/requirements-torch.txt"
"${pip[@]}" --no-build-isolation -c "$pins/requirements-torch.txt" -r "$pins/requirements-deepspeed.txt"
"${pip[@]}" -c "$pins/requirements-torch.txt" -c "$pins/requirements-deepspeed.txt" -r "$pins/requirements-train.txt"
echo "$stamp" > "$venv/.gpuctl-pins"
echo "gpuctl-bootstrap: node side installed in $venv (pins $stamp)"
