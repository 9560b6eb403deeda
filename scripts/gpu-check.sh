#!/usr/bin/env bash
# The device check (docs/gpu.md): the CUDA-marked tests, a bf16 training run restored
# bitwise on the CPU, the checkpoint benchmark on GPU tensors against DCP and the pinned
# copy floor, an emergency save on notice. One GPU, at most 8 minutes, no network.
#
#   scripts/gpu-check.sh [--out FILE] [--dry-run] [--sizes-mib 1024,8192,32768] ...
#
# Writes one JSON of figures (default gpu-check.json; rewritten after every part, so a
# kill keeps what was measured). Without CUDA, or with --dry-run, every part runs on the
# CPU with tiny sizes and the JSON says "cuda": false.
#
# Python: $PYTHON, else .venv/bin/python when it holds torch, else python3. Modules that
# interpreter lacks are installed from the wheels in $RELIGHT_WHEELS (default wheelhouse/,
# made by scripts/gpu-wheels.sh on a machine with the registry) into .gpu-venv, a venv
# that sees the interpreter's own packages (torch stays the machine's); nothing is
# downloaded.
set -uo pipefail
cd "$(dirname "$0")/.."

LIMIT_S="${RELIGHT_GPU_CHECK_LIMIT_S:-480}"
BUDGET_S=$(( LIMIT_S - 30 ))
WHEELS="${RELIGHT_WHEELS:-wheelhouse}"

PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ] && .venv/bin/python -c "import torch" 2>/dev/null; then
    PY=.venv/bin/python
  else
    PY=python3
  fi
fi

# import name -> wheel name, for what the check imports.
NEEDED="numpy:numpy tensorstore:tensorstore fsspec:fsspec zstandard:zstandard
google_crc32c:google-crc32c crc32c:crc32c ml_dtypes:ml_dtypes psutil:psutil
prometheus_client:prometheus-client pytest:pytest pytest_timeout:pytest-timeout"
missing() {
  local py="$1" out=""
  for pair in $NEEDED; do
    "$py" -c "import ${pair%%:*}" 2>/dev/null || out="$out ${pair##*:}"
  done
  echo "$out"
}

if ! "$PY" -c "import torch" 2>/dev/null; then
  echo "gpu-check: $PY cannot import torch" >&2
  exit 3
fi
lack="$(missing "$PY")"
if [ -n "$lack" ]; then
  if [ -d "$WHEELS" ]; then
    [ -x .gpu-venv/bin/python ] || "$PY" -m venv --system-site-packages .gpu-venv
    # shellcheck disable=SC2086
    .gpu-venv/bin/python -m pip install -q --no-index --find-links "$WHEELS" $lack \
      || echo "gpu-check: installing$lack from $WHEELS failed" >&2
    PY=.gpu-venv/bin/python
    lack="$(missing "$PY")"
  fi
  if [ -n "$lack" ]; then
    echo "gpu-check: $PY lacks$lack (no wheels for them in $WHEELS); the parts that" \
         "need them will report errors" >&2
  fi
fi

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
echo "gpu-check: $("$PY" -c 'import torch,sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.cuda.is_available())')" >&2
# Hard limit over everything; the driver's own budget ends its parts before it.
timeout --kill-after=10 "$LIMIT_S" "$PY" -m relight.benchmarks.gpu_check --budget-s "$BUDGET_S" "$@"
rc=$?
if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
  echo "gpu-check: killed at the ${LIMIT_S} s limit; the JSON holds the parts that finished" >&2
fi
exit "$rc"
