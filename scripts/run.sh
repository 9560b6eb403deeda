#!/usr/bin/env bash
# The main job: a local multi-rank training run on real text with embedded defaults — an
# embedded etcd for the rendezvous, checkpoints under runs/local/ckpt. The corpus is the
# English text of Python's documentation topics (pydoc_data.topics, shipped with CPython),
# as UTF-8 bytes; it is prepared into runs/data/ on the first run
# (a few seconds, no network). Extra arguments go to the training command (e.g.
# --train.steps=400); DATA=synthetic trains on the Markov-chain corpus of configs/tiny.toml
# (run directory runs/local-synthetic).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
run_dir=runs/local
if [ "${DATA:-text}" = synthetic ]; then
  config=configs/tiny.toml run_dir=runs/local-synthetic
else
  config=configs/text.toml
  dataset=runs/data/pydoc-topics-byte
  if [ ! -f "$dataset/index.json" ]; then
    [ -f runs/data/pydoc-topics.jsonl ] || .venv/bin/relight data pydoc-topics runs/data/pydoc-topics.jsonl
    .venv/bin/relight data prepare runs/data/pydoc-topics.jsonl --tokenizer byte --out "$dataset"
  fi
fi
exec .venv/bin/relight run --nproc-per-node="${NPROC:-2}" --run-dir="$run_dir" -- \
  .venv/bin/python -m relight.runtime.train --config "$config" \
  --checkpoint.url="$run_dir/ckpt" --train.metrics_path="$run_dir/metrics.jsonl" "$@"
