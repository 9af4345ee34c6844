#!/usr/bin/env bash
# The test command (README quick start, step 2). Installs what the suite needs on a fresh
# Debian machine (sshd, pdsh, dockerd, an image registry, debootstrap, S3 peers), then runs pytest. The suite starts its
# own services on loopback (sshd on 127.0.0.1/127.0.0.2, moto S3 server, dockerd with vfs), and
# builds the trainer image (cpu flavour) on a debootstrap base; that build is cached between runs
# under ${GPUCTL_CACHE_DIR:-~/.cache/gpuctl} (tests/trainer_image.py).
set -euo pipefail
cd "$(dirname "$0")/.."

# Every phase's wall time, printed at the end (and on failure), so the suite's cost stays in view.
PHASES=()
phase_start=$SECONDS
phase() { PHASES+=("$(printf '%-24s %5ds' "$1" $((SECONDS - phase_start)))"); phase_start=$SECONDS; }
GPUCTL_TEST_PHASES=$(mktemp)
export GPUCTL_TEST_PHASES
print_phases() {
  echo "wall time by phase:"
  printf '  %s\n' "${PHASES[@]}"
  cat "$GPUCTL_TEST_PHASES" 2>/dev/null
  echo "  total                    ${SECONDS}s"
  rm -f "$GPUCTL_TEST_PHASES"
}
trap print_phases EXIT

APT_PACKAGES=(openssh-server openssh-client pdsh docker.io docker-registry iproute2 procps debootstrap slurm-wlm)
missing=()
for pkg in "${APT_PACKAGES[@]}"; do dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg"); done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "installing ${missing[*]}"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

PY="${PYTHON:-python}"
if ! "$PY" -c "import torch" 2>/dev/null; then "$PY" -m pip install -q torch==2.13.0; fi
"$PY" -m pip install -q -e '.[train,test]'
phase "apt + pip"

# DeepSpeed JIT-compiles its CPU ops on first use; keep them between runs, one folder per venv
# (as launch.sh does): two venvs sharing one folder rebuild each other's ops, 1-4 min each time.
TORCH_EXTENSIONS_DIR="$("$PY" -c 'from trainer.hostenv import ops_cache_default; print(ops_cache_default())')"
export TORCH_EXTENSIONS_DIR
# A build killed half way (a rank or a whole test run stopped while it compiled) leaves its `lock` file,
# and every later load of that op waits on it for ever. No compiler running: every lock is such a
# leftover; else only an old one is (another run may be building right now).
if pgrep -x ninja >/dev/null || pgrep -x cc1plus >/dev/null; then
  find "$TORCH_EXTENSIONS_DIR" -name lock -mmin +30 -delete 2>/dev/null || true
else
  find "$TORCH_EXTENSIONS_DIR" -name lock -delete 2>/dev/null || true
fi
# Build them once, in one process, before any test starts ranks (3 ranks compiling at once
# on 2 cores is slow and memory-hungry).
DS_ACCELERATOR=cpu "$PY" -c "
from deepspeed.accelerator import get_accelerator
for name in ('CPUAdamBuilder', 'ShareMemCommBuilder'):
    get_accelerator().create_op_builder(name).load()
print('deepspeed CPU ops ready')
"
phase "deepspeed op build"
# Style and types first: they take seconds and fail fast.
"$PY" -m ruff check .
"$PY" -m ruff format --check .
"$PY" -m mypy
phase "ruff + mypy"
set +e
# --durations: the 25 slowest tests, at every run (the trainer image build is inside the first
# test that asks for it: see its setup time there).
# Workers: --dist loadgroup keeps three serial lines on a worker each (the image engine's tests and
# two lines of real-rank runs, tests/conftest.py); the rest mostly wait (on a fake vendor's cap, an
# sshd, a container) rather than compute. So: at least 4, else cores + 2; GPUCTL_TEST_WORKERS=0 runs
# in one process.
CORES=$(nproc)
WORKERS="${GPUCTL_TEST_WORKERS:-$(( CORES + 2 > 4 ? CORES + 2 : 4 ))}"
XDIST=(-n "$WORKERS" --dist loadgroup)
[ "$WORKERS" = 0 ] && XDIST=()
"$PY" -m pytest -q -p no:cacheprovider --durations=25 "${XDIST[@]}" "$@"
rc=$?
set -e
phase "pytest"
if [ "$rc" = 5 ]; then echo "no tests ran: that is a failure"; exit 1; fi
exit "$rc"
