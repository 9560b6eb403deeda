#!/usr/bin/env bash
# The test suite (what CI runs). The tests start their own real servers (etcd, SeaweedFS
# S3) on loopback ports; nothing needs to be running beforehand. `--long` adds the long
# end-to-end and soak runs (marked `long`), about six minutes more on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
.venv/bin/ruff check .
if [ "${1:-}" = "--long" ]; then
  shift
  set -- -m "long or not long" "$@"
fi
exec .venv/bin/python -m pytest "$@"
