"""Per-step metrics: a JSONL file and a progress line, both from rank 0; plus the estimates
(FLOPs per token, MFU, memory) that go into them."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch

from relight.rank_log import rank_step_prefix
from relight.runtime.config import ModelConfig

__all__ = ["MetricsWriter", "flops_per_token", "memory_mb", "peak_flops"]

log = logging.getLogger(__name__)

# Dense bf16 tensor-core peaks (FLOP/s) of GPUs this is likely to meet; MFU is null elsewhere.
_GPU_PEAKS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12}


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward): 6 x active non-embedding params plus
    attention scores, the usual estimate (PaLM appendix B)."""
    d, h = cfg.dim, cfg.mlp_hidden
    attn = 4 * d * d
    dense_mlp = 3 * d * h
    moe_mlp = cfg.top_k * 3 * d * h + d * cfg.num_experts
    mlp = sum(moe_mlp if cfg.is_moe_layer(i) else dense_mlp for i in range(cfg.n_layers))
    active = cfg.n_layers * attn + mlp + d * cfg.vocab_size  # output projection counts
    return 6.0 * active + 12.0 * cfg.n_layers * d * seq_len


def peak_flops(device: torch.device, configured_tflops: float) -> float | None:
    if configured_tflops > 0:
        return configured_tflops * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in _GPU_PEAKS.items():
            if key in name:
                return value
    return None


def memory_mb(device: torch.device) -> float:
    """Peak allocated device memory on CUDA; the process RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        import psutil

        return psutil.Process(os.getpid()).memory_info().rss / 2**20
    except ImportError:  # pragma: no cover - psutil is a dependency
        return float("nan")


class MetricsWriter:
    """Appends one JSON object per step to ``path`` (when set) and logs a progress line."""

    def __init__(self, path: str, *, enabled: bool, log_every: int) -> None:
        self.enabled = enabled
        self.log_every = log_every
        self._fh = None
        if enabled and path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            # One os.write per record on an O_APPEND descriptor: replica groups append to
            # one file, and a record must never interleave with another group's.
            self._fh = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._console = None
        if enabled and sys.stderr.isatty():
            try:
                from rich.console import Console

                self._console = Console(stderr=True)
            except ImportError:  # pragma: no cover
                self._console = None

    def write(self, record: dict[str, Any], total_steps: int) -> None:
        if not self.enabled:
            return
        if self._fh is not None:
            os.write(self._fh, (json.dumps(record) + "\n").encode())
        step = record["step"]
        if step % self.log_every and step != total_steps:
            return
        mfu = record.get("mfu")
        line = (
            f"{rank_step_prefix(0, step)} of {total_steps} | loss {record['loss']:.4f} | "
            f"lr {record['lr']:.2e} | "
            f"{record['tokens_per_s']:,.0f} tok/s | {record['step_time_s'] * 1e3:.0f} ms | "
            f"ckpt {record['ckpt_stall_s'] * 1e3:.0f} ms | mem {record['mem_max_mb']:.0f} MB | "
            f"mfu {'n/a' if mfu is None else f'{mfu:.1%}'} | {record['layout']}"
        )
        if self._console is not None:
            self._console.print(f"[bold cyan]{line}[/]", highlight=False)
        else:
            log.info("%s", line)

    def close(self) -> None:
        if self._fh is not None:
            os.close(self._fh)
            self._fh = None
