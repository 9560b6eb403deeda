"""A pool of long-lived worker processes that run multi-rank test cases over gloo.

Importing torch costs ~1.5 s per process, so a test module starts its workers once and runs
many cases on them. Each case gets a fresh process group (a new TCPStore port, rank 0 hosts
it) over the first ``world`` workers and destroys it afterwards, so cases do not share state.
A case is named ``"module:function"``; it runs on every rank with the given kwargs and returns
a picklable value (this is test plumbing between our own processes, not a load path).
"""

from __future__ import annotations

import gc
import importlib
import multiprocessing as mp
import os
import queue
import resource
import socket
import time
import traceback
from typing import Any


class RankFailure(RuntimeError):
    """One or more ranks failed; ``errors`` maps rank -> formatted traceback."""

    def __init__(self, case: str, errors: dict[int, str]) -> None:
        self.errors = errors
        body = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        super().__init__(f"case {case} failed on ranks {sorted(errors)}:\n{body}")


_MAX_THREADS = 1000
"""Workers are replaced once one holds more threads than this. Process groups outlive
their case (objects torch keeps, DTensor's caches among them, hold its device meshes):
each keeps its gloo threads and sockets. They sit idle, so replacing a worker (seconds
of imports on two cores) is kept for when they pile up: the runtime tests' ~40 cases
left up to ~540 threads and ~940 open files in one worker here."""


def _threads(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
    except (OSError, StopIteration):
        return 0


def _open_files(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def _worn(pid: int) -> bool:
    """Whether a worker holds so many leftover threads or sockets that it should be
    replaced: over `_MAX_THREADS`, or over a quarter of the open-file limit (the pool's,
    which its workers inherit)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return _threads(pid) > _MAX_THREADS or _open_files(pid) > soft // 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(tasks: Any, results: Any, collective_timeout_s: float) -> None:
    import logging
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    while True:
        item = tasks.get()
        if item is None:
            return
        fn_name, port, rank, world, kwargs = item
        try:
            dist.init_process_group(
                "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                timeout=timedelta(seconds=collective_timeout_s),
            )
            mod, fn = fn_name.split(":")
            out = getattr(importlib.import_module(mod), fn)(**kwargs)
            results.put((rank, True, out))
        except BaseException:  # noqa: BLE001 - report everything to the test
            results.put((rank, False, traceback.format_exc()))
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
            # The case's process groups are freed only with the objects that hold them
            # (meshes, FSDP state, in reference cycles): each keeps gloo threads polling,
            # which on a long run of cases would slow every later case down.
            gc.collect()


class RankPool:
    def __init__(self, size: int, *, collective_timeout_s: float = 60.0) -> None:
        self.size = size
        self.collective_timeout_s = collective_timeout_s
        self._start()

    def _start(self) -> None:
        self._ctx = mp.get_context("spawn")
        self.results = self._ctx.Queue()
        self.tasks: list[Any] = []
        self.procs: list[Any] = []
        self._spawn(self.size)

    def _spawn(self, n: int) -> None:
        env = {"OMP_NUM_THREADS": "1"}
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            for _ in range(n):
                q = self._ctx.Queue()
                p = self._ctx.Process(target=_worker,
                                      args=(q, self.results, self.collective_timeout_s),
                                      daemon=True)
                p.start()
                self.tasks.append(q)
                self.procs.append(p)
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def run(self, case: str, world: int, *, timeout: float = 150.0, **kwargs: Any) -> list[Any]:
        """Run ``case`` on ranks 0..world-1; returns the per-rank results in rank order."""
        if world > len(self.procs):  # grow on demand (an 8-rank case in a 4-rank pool)
            self._spawn(world - len(self.procs))
        port = free_port()
        for r in range(world):
            self.tasks[r].put((case, port, r, world, kwargs))
        out: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(out) + len(errors) < world:
            try:
                rank, ok, value = self.results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                missing = sorted(set(range(world)) - set(out) - set(errors))
                self.restart()
                raise RankFailure(case, {r: f"no result within {timeout} s" for r in missing}
                                  | errors) from None
            (out if ok else errors)[rank] = value
        if errors:
            raise RankFailure(case, errors)
        if any(_worn(p.pid) for p in self.procs):
            self.restart()
        return [out[r] for r in range(world)]

    def restart(self) -> None:
        self.close()
        self.size = max(self.size, len(self.procs))
        self._start()

    def close(self) -> None:
        for q in self.tasks:
            try:
                q.put(None)
            except (OSError, ValueError):
                pass
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
