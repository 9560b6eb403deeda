"""`relight bench data`: token-dataset preparation throughput and the loader's cost per step.

1. Preparation: the standard library's Python sources (up to ``--max-mb`` MB, files in name
   order) through ``relight data prepare`` with the byte-level tokenizer and a BPE trained on
   them (``train:VOCAB``), with 1 and ``--workers`` processes: MB/s of text and tokens/s of
   the encoding (the BPE's training time reported apart).
2. Loader: a trainer of ``--config`` (one process) runs ``--steps`` steps; the time of
   reading a step's micro-batches (`runtime.data.DataLoader.next_step`) is measured on its
   own over the same positions and set against the median step time.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["main"]


def _stdlib_files(max_bytes: int) -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    out, total = [], 0
    for f in sorted(root.rglob("*.py")):
        if "site-packages" in f.parts or not f.is_file():
            continue
        out.append(str(f))
        total += f.stat().st_size
        if total >= max_bytes:
            break
    return out


def bench_prepare(max_mb: float, vocab: int, workers: int) -> list[dict[str, Any]]:
    from relight.runtime.prepare import prepare

    files = _stdlib_files(int(max_mb * 1e6))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for tok in ("byte", f"train:{vocab}"):
            for w in sorted({1, workers}):
                out = Path(tmp) / f"{tok.replace(':', '')}-{w}"
                s = prepare(files, tokenizer=tok, out=out, workers=w, shard_mb=4.0)
                rows.append({"tokenizer": tok, "workers": w, "files": len(files),
                             "shards": s.shards, "text_mb": s.text_bytes / 1e6,
                             "tokens": s.tokens, "seconds": s.seconds,
                             "mb_per_s": s.mb_per_s, "tokens_per_s": s.tokens_per_s,
                             "train_tokenizer_s": s.train_tokenizer_s})
                shutil.rmtree(out)
    return rows


def bench_loader(config: str, steps: int, overrides: list[str]) -> dict[str, Any]:
    from relight.runtime.config import load_config
    from relight.runtime.data import DataLoader
    from relight.runtime.train import Trainer

    cfg = load_config(config, [f"--train.steps={steps}", *overrides])
    trainer = Trainer(cfg)
    try:
        step_s = []
        for _ in range(steps):
            t0 = time.perf_counter()
            trainer.train_step()
            step_s.append(time.perf_counter() - t0)
        loader = DataLoader(trainer.data.corpus, trainer.plan)
        read_s = []
        for _ in range(steps):
            t0 = time.perf_counter()
            loader.next_step()
            read_s.append(time.perf_counter() - t0)
    finally:
        trainer.close()
    warm = step_s[min(3, steps - 1):]
    step, read = statistics.median(warm), statistics.median(read_s)
    return {"config": config, "source": cfg.data.source, "steps": steps,
            "samples_per_step": cfg.data.global_batch_size, "step_s_median": step,
            "loader_s_median": read, "loader_share": read / step}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="relight bench data", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-mb", type=float, default=20.0, help="stdlib source MB to prepare")
    p.add_argument("--vocab", type=int, default=4096, help="ids of the trained BPE")
    p.add_argument("--workers", type=int, default=2, help="processes of the parallel arm")
    p.add_argument("--config", default="configs/text.toml", help="config of the loader arm")
    p.add_argument("--steps", type=int, default=30, help="training steps of the loader arm")
    p.add_argument("--skip-prepare", action="store_true")
    p.add_argument("--json", help="write the results to this file")
    args, overrides = p.parse_known_args(argv)
    out: dict[str, Any] = {}
    if not args.skip_prepare:
        out["prepare"] = bench_prepare(args.max_mb, args.vocab, args.workers)
        for r in out["prepare"]:
            print(f"prepare {r['tokenizer']:<11} workers {r['workers']}: {r['text_mb']:.1f} MB "
                  f"({r['files']} files, {r['shards']} shards) -> {r['tokens']:,} tokens in "
                  f"{r['seconds']:.2f} s: {r['mb_per_s']:.2f} MB/s, {r['tokens_per_s']:,.0f} "
                  "tokens/s" + (f" (BPE trained in {r['train_tokenizer_s']:.1f} s)"
                                if r["train_tokenizer_s"] else ""))
    out["loader"] = bench_loader(args.config, args.steps, overrides)
    r = out["loader"]
    print(f"loader on {r['source']}: {r['loader_s_median'] * 1e3:.3f} ms per step of "
          f"{r['samples_per_step']} samples against a {r['step_s_median'] * 1e3:.1f} ms step: "
          f"{r['loader_share']:.2%} of the step")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0
