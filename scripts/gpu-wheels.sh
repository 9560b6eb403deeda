#!/usr/bin/env bash
# Downloads, on a machine that reaches the package registry, the wheels that
# scripts/gpu-check.sh installs where the GPU machine's python lacks them (it has no
# network). The folder travels with the working tree (it is git-ignored).
#
#   scripts/gpu-wheels.sh [PYTHON_VERSION (default 3.12)] [DIR (default wheelhouse)]
set -euo pipefail
cd "$(dirname "$0")/.."
ver="${1:-3.12}"
dir="${2:-wheelhouse}"
PY="${PYTHON:-python3}"
"$PY" -m pip download -q --only-binary=:all: --implementation cp --python-version "$ver" \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d "$dir" \
  numpy tensorstore fsspec zstandard google-crc32c crc32c ml_dtypes psutil \
  prometheus-client pytest pytest-timeout
du -sh "$dir" >&2
