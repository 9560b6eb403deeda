#!/usr/bin/env bash
# The main job: a local multi-rank training run on embedded defaults — an embedded
# etcd for the rendezvous, checkpoints under runs/local/ckpt. Extra arguments go to
# the training command (e.g. --train.steps=200).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/relight run --nproc-per-node="${NPROC:-2}" --run-dir=runs/local -- \
  .venv/bin/python -m runtime.train --config configs/tiny.toml \
  --checkpoint.url=runs/local/ckpt --train.metrics_path=runs/local/metrics.jsonl "$@"
