"""A pool of real gloo ranks, started once per test module.

Each worker joins one process group (file rendezvous, loopback) and then runs test
cases sent over a queue: `pool.run("tests.ckpt.cases:fn", **kwargs)` calls `fn(**kwargs)`
on every rank and returns their (JSON-able) results. Messages carry no tensors.
"""

from __future__ import annotations

import importlib
import os
import queue
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any

import torch.multiprocessing as mp

__all__ = ["RankPool", "RankFailure"]


class RankFailure(AssertionError):
    """Some ranks raised or died; `failures` rank -> traceback, `results` of the others."""

    def __init__(self, failures: dict[int, str], results: dict[int, Any] | None = None) -> None:
        super().__init__("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items())))
        self.failures = failures
        self.results = results or {}


def _worker(rank: int, world: int, init: str, inbox: Any, outbox: Any, env: dict) -> None:
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    while True:
        msg = inbox.get()
        if msg is None:
            break
        target, kwargs = msg
        try:
            mod, fn = target.split(":")
            result = getattr(importlib.import_module(mod), fn)(**kwargs)
            outbox.put((rank, True, result))
        except BaseException:  # noqa: BLE001 - reported to the parent
            outbox.put((rank, False, traceback.format_exc()))
    # No destroy_process_group(): it waits on peers that may be gone; the process exits.


class RankPool:
    def __init__(self, world: int, env: dict[str, str] | None = None) -> None:
        self.world = world
        ctx = mp.get_context("spawn")
        self._dir = tempfile.mkdtemp(prefix="ckpt-pool-")
        init = f"file://{self._dir}/rendezvous"
        self.inboxes = [ctx.Queue() for _ in range(world)]
        self.outbox = ctx.Queue()
        env = dict(env or {})
        self.procs = [
            ctx.Process(target=_worker, args=(r, world, init, self.inboxes[r], self.outbox, env),
                        daemon=True)
            for r in range(world)
        ]
        for p in self.procs:
            p.start()

    def run(self, target: str, timeout: float = 120.0, ranks: list[int] | None = None,
            **kwargs: Any) -> list[Any]:
        """Run `target(**kwargs)` on every rank (or `ranks`); results in rank order."""
        ranks = list(range(self.world)) if ranks is None else ranks
        for r in ranks:
            self.inboxes[r].put((target, kwargs))
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(results) + len(failures) < len(ranks):
            try:
                rank, ok, value = self.outbox.get(timeout=0.5)
                (results if ok else failures)[rank] = value
                continue
            except queue.Empty:
                pass
            for r in ranks:
                if r not in results and r not in failures and not self.procs[r].is_alive():
                    failures[r] = f"rank {r} died (exit code {self.procs[r].exitcode})"
            if time.monotonic() > deadline:
                for r in ranks:
                    if r not in results and r not in failures:
                        failures[r] = f"no answer after {timeout} s"
        if failures:
            raise RankFailure(failures, results)
        return [results[r] for r in ranks]

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self, timeout: float = 3.0) -> None:
        for q, p in zip(self.inboxes, self.procs, strict=True):
            if p.is_alive():
                q.put(None)
        for p in self.procs:
            p.join(timeout=timeout)
            if p.is_alive():
                p.kill()
