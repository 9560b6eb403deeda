#!/usr/bin/env bash
# torchft's own environment for the goodput benchmark's torchft arm
# (benchmarks/torchft_arm.py). torchft is never a dependency of Relight: it lives here.
#
#   bash scripts/torchft-env.sh [VENV_DIR]     # default: .venv-torchft in the repository
#   RELIGHT_TORCHFT_PYTHON=VENV_DIR/bin/python relight bench goodput ...
#
# torch==2.13.0 resolves to the CPU wheel here (an unpinned torch pulls a CUDA build);
# numpy is for Relight's synthetic corpus (runtime.data), which the arm trains on.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-$root/.venv-torchft}"
python3 -m venv "$venv"
"$venv/bin/pip" install --quiet torch==2.13.0 torchft==0.2.0 numpy==2.4.6
# Relight's own model, data and metrics code, without its dependencies (the arm needs
# torch and numpy only), installed as the `relight` package it imports.
"$venv/bin/pip" install --quiet --no-deps -e "$root"
"$venv/bin/python" -c "import torch, torchft, numpy; print('torchft env:', torch.__version__)"
test -x "$venv/bin/torchft_lighthouse"
echo "RELIGHT_TORCHFT_PYTHON=$venv/bin/python"
