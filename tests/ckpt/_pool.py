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
import traceback
from datetime import timedelta
from typing import Any

import torch.multiprocessing as mp

__all__ = ["RankPool", "RankFailure"]


class RankFailure(AssertionError):
    def __init__(self, failures: dict[int, str]) -> None:
        super().__init__("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items())))
        self.failures = failures


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
    dist.destroy_process_group()


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
        for _ in ranks:
            try:
                rank, ok, value = self.outbox.get(timeout=timeout)
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                raise RankFailure({-1: f"timeout after {timeout} s; dead ranks {dead}"}) from None
            (results if ok else failures)[rank] = value
        if failures:
            raise RankFailure(failures)
        return [results[r] for r in ranks]

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self) -> None:
        for q, p in zip(self.inboxes, self.procs, strict=True):
            if p.is_alive():
                q.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
