#!/usr/bin/env bash
# C++ compiler wrapper for the image build (installed as /opt/gpuctl/cc/g++, used via CXX=).
#
# DeepSpeed compiles its CPU ops (CPU Adam) with -march=native and the widest SIMD the BUILD
# machine has (-D__AVX512__ on an AVX-512 builder). A prebuilt image then dies with SIGILL on a
# rented GPU host whose CPU lacks those instructions. This pins both to a baseline every x86-64
# GPU host has: GPUCTL_CPU_ARCH (default x86-64-v3: AVX2 + FMA, Haswell / Zen 1 and newer) and
# 256-bit SIMD. Everything else goes to g++ unchanged.
set -euo pipefail
args=()
for arg in "$@"; do
  case "$arg" in
    -march=native) args+=("-march=${GPUCTL_CPU_ARCH:-x86-64-v3}") ;;
    -D__AVX512__) args+=("-D__AVX256__") ;;
    *) args+=("$arg") ;;
  esac
done
exec "${GPUCTL_REAL_CXX:-g++}" "${args[@]}"
