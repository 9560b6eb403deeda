#!/usr/bin/env bash
# Creates .venv (when missing or stale) and installs Relight with its test tools.
# CPU machines get torch==2.13.0 first (the CPU wheel here); a GPU user sets
# RELIGHT_TORCH_INDEX to PyTorch's CUDA wheel index (see README) before the first run.
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-python3}"
VENV=".venv"
STAMP="$VENV/.relight-installed"
want="$(cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -d' ' -f1)"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  exit 0
fi

started=$(date +%s)
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  if [ -n "${RELIGHT_TORCH_INDEX:-}" ]; then
    "$VENV/bin/pip" install -q "torch==${RELIGHT_TORCH_VERSION:-2.13.0}" --index-url "$RELIGHT_TORCH_INDEX"
  else
    "$VENV/bin/pip" install -q "torch==2.13.0"
  fi
fi
"$VENV/bin/pip" install -q -e ".[test]"
echo "$want" > "$STAMP"
echo "relight: environment ready in .venv ($(( $(date +%s) - started ))s)" >&2
