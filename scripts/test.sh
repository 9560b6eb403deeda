#!/usr/bin/env bash
# The whole test suite. The tests start their own real servers (etcd, SeaweedFS S3)
# on loopback ports; nothing needs to be running beforehand.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
.venv/bin/ruff check .
exec .venv/bin/python -m pytest "$@"
