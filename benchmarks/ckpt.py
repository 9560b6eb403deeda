"""Checkpoint benchmark: Relight's ckpt vs torch.distributed.checkpoint (DCP), side by side.

    python -m relight.benchmarks.ckpt --mb 512 --ranks 4 --storage file|s3 --json OUT.json

Both systems get the same state on the same gloo ranks: fp32 parameters plus two Adam
moments, FSDP-style Shard(0) DTensors over `--ranks`. Phases alternate between the two
systems (ABBA order over `--rounds`), and each figure is the median over rounds:

- save_s: synchronous save, barrier to barrier, slowest rank;
- stall_s / async_total_s: async save, until the call returns / until it is durable;
- step_s: a stand-in for the training step that follows an async save: `--step-iters`
  single-threaded 256x256 fp32 matmuls per rank, run as soon as the async save returns
  (so async_total_s is the save's time with the training running beside it); the
  floor's step_s is the same step with no save running (`--step-iters 0`: no step);
- load_s: load into the same layout (zeroed targets) of the newest checkpoint (the async
  save's), or with `--load-from sync` of the sync save's, made just before it (a
  restore that reads the checkpoint before the newest, as a run whose newest save is
  still in flight or failed does); every such load, and the first round's resharded
  loads, are compared bit for bit with the saved state (`loads_bitwise_equal`);
  reshard_load_s: the newest checkpoint into dp2 x tp2 (Shard(0), Shard(1)) DTensors;
- bytes_written: bytes of the objects under the checkpoint prefix after the save;
- bytes_read_reshard: bytes the ranks read during the reshard load, summed over ranks:
  on files the /proc/self/io rchar delta for DCP (read()/pread() syscalls, page cache
  included) and Relight's store counter for Relight (its reads of cached pages map them:
  rchar does not see them);
  on S3 the payload bytes fetched, counted in s3fs (DCP's fsspec reader, Relight's direct
  shard reads) and by tensorstore's own kvstore counters (Relight's tensorstore reads);
  Relight's chunk accounting is in "extra" (`relight_reshard_chunk_bytes`, and
  `relight_reshard_reads`: the requests its store made for them, summed over ranks);
- peak_rss_mb: extra host memory: the largest rise of a rank's RSS during any timed
  phase of that system (targets are allocated before a phase starts), sampled every 5 ms;
- on files, `--condition kept` (the default) leaves every system's earlier rounds on
  disk, as a run that keeps its last 3 checkpoints does: a system's round 3 back is
  deleted once its saves of this round are done, as retention runs right after a
  commit; saves meet a page cache full of earlier checkpoints. `--condition fresh`
  deletes each system's previous round before its next one, so every save finds the
  page cache in the same state;
- `--train-gap-s` (default 5): after every arm (one system's saves and loads of a
  round, or the floor's) all ranks idle that long, standing in for the training
  between a run's saves. It matters where the kernel hands freed pages back to a
  hypervisor (virtio-balloon free page reporting, after about 2 s): a page taken
  again from there costs a fault on the host, one freed an instant before does not.
  With 0, a system's save may write into pages the arm before it just freed, which a
  run's save, minutes after its retention ran, never finds;
- ratios: dcp/relight per round (the systems ran back to back), median over rounds;
- pipelined_return_s / pipelined_staged_s / pipelined_total_s: Relight's async save with
  `SaveOptions(pipelined_staging=True)`: until save() returns / until `wait_staged()`
  returns (the state may change; no compute in between) / until durable; their ratios
  are against DCP's stall_s and async_total_s (`stall_s_vs_pipelined_return_s`, ...).

- on files, `--load-cache cold` (the default) drops every checkpoint from the page cache
  before each of its loads (every system's, and the floor's), as a job resumed on
  another node reads it, and waits `--cold-settle-s` (default 5) before the load: the
  dropped pages go back to the free pool (and, on a VM with free page reporting, to
  the host) as a resumed job's node holds no pages freed a moment before; `as-saved`
  loads with whatever the saves left cached, as a
  process restarted on the same node does (writes through the page cache leave their
  pages there, Relight's with `RELIGHT_DIRECT_IO=1` none); `dropped` (root only) empties
  the whole page cache, dentries and inodes included (`echo 3 >
  /proc/sys/vm/drop_caches`), before every load, then waits `--cold-settle-s`; extra
  `relight_load_cached_share` is the share of Relight's load the cache served;
- `--layers N` sets how many weight matrices the state has (default: one per 48 MiB),
  `--no-biases` leaves out their biases (`--layers 8 --no-biases`: 24 tensors);
- floor: what the machine itself allows for the same bytes, in the same rounds: save_s =
  one object per rank (a file written and fsynced; on S3 one PUT), save_direct_s (files)
  = the same file written around the page cache (`O_DIRECT`) from one aligned buffer
  joined beforehand, load_s = that object read back into the tensors, stall_s = a copy
  into preallocated buffers, timed right after the floor's save as both systems' async
  saves come right after their sync saves (extra `floor_copy_after_loads_s`: the same
  copy after the loads); "floor_ratios" are floor / system (1.0: the system runs at
  the floor, so no format could beat it by more); `*_save_s_direct` against the direct
  write.

The "extra" section has supporting figures (direct vs broadcast reads
of replicated regions, staging buffer size, objects per checkpoint).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from datetime import timedelta
from typing import Any

HIDDEN = 2048
KEPT_ROUNDS = 3
"""Rounds each system's checkpoints stay on disk under `--condition kept` (keep_last=3)."""


_S3FS_BYTES = [0]


def _count_s3fs_reads() -> None:
    """Count the payload bytes s3fs fetches (DCP's fsspec reader goes through here)."""
    import s3fs.core

    real = s3fs.core._fetch_range

    def counted(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        out = real(*a, **kw)
        _S3FS_BYTES[0] += len(out)
        return out

    s3fs.core._fetch_range = counted
    real_cat = s3fs.core.S3FileSystem._cat_file

    async def counted_cat(self, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        out = await real_cat(self, *a, **kw)
        _S3FS_BYTES[0] += len(out)
        return out

    s3fs.core.S3FileSystem._cat_file = counted_cat


def _ts_bytes_read() -> int:
    import tensorstore as ts

    total = 0
    for m in ts.experimental_collect_matching_metrics("/tensorstore/kvstore/"):
        if m["name"].endswith("/bytes_read"):
            total += sum(int(v.get("value", 0)) for v in m.get("values", []))
    return total


def _bytes_read_now(s3: bool) -> int:
    """Bytes read so far: socket payloads on S3 (s3fs + tensorstore counters), read()/pread()
    syscalls (/proc/self/io rchar) on files."""
    return _S3FS_BYTES[0] + _ts_bytes_read() if s3 else _rchar()


def _rchar() -> int:
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("rchar:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class RssSampler:
    """Peak RSS of this process over a window, sampled in a thread."""

    def __init__(self) -> None:
        import psutil

        self.proc = psutil.Process()
        self.peak = 0
        self.on = False
        self.stop = False
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self.stop:
            if self.on:
                self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.005)

    def window(self, on: bool) -> None:
        if on:
            self.peak = self.proc.memory_info().rss
        self.on = on


def _layers(mb: int, ranks: int, layers: int | None = None) -> tuple[int, int]:
    """(number of weight matrices, rows of each) so params + 2 moments ~ mb MiB."""
    n = layers or max(1, mb // 48)
    rows = int(mb * 2**20 / 3 / (n * HIDDEN * 4))
    rows -= rows % (ranks * 4)
    return n, max(rows, ranks * 4)


def _state(mesh: Any, n: int, rows: int, placements: Any, bias_pl: Any, fill: bool,
           biases: bool = True) -> dict:
    import torch
    from torch.distributed.tensor import distribute_tensor

    def make(shape, pl, seed):
        g = torch.Generator().manual_seed(seed)
        full = torch.randn(shape, generator=g) if fill else torch.zeros(shape)
        return distribute_tensor(full, mesh, pl)

    model, optim = {}, {}
    for i in range(n):
        w, b = f"layers.{i}.weight", f"layers.{i}.bias"
        model[w] = make((rows, HIDDEN), placements, 3 * i)
        optim[w] = {"exp_avg": make((rows, HIDDEN), placements, 3 * i + 1),
                    "exp_avg_sq": make((rows, HIDDEN), placements, 3 * i + 2)}
        if biases:
            model[b] = make((rows,), bias_pl, 3 * i + 100000)
            optim[b] = {"exp_avg": make((rows,), bias_pl, 3 * i + 200000),
                        "exp_avg_sq": make((rows,), bias_pl, 3 * i + 300000)}
    return {"model": model, "optim": {"state": optim}}


def _prefix_bytes(url: str) -> tuple[int, int]:
    from relight import storage

    store = storage.open_store(url)
    keys = store.list()
    return sum(store.size(k) for k in keys), len(keys)


def _local_bytes(state: dict) -> list[memoryview]:
    """This rank's shard of every tensor of `state`, as raw bytes views (no copy)."""
    from relight.ckpt.flatten import flatten_state

    out = []
    for leaf in flatten_state(state).tensors.values():
        t = leaf.tensor
        local = t.to_local() if hasattr(t, "to_local") else t
        out.append(memoryview(local.contiguous().numpy()).cast("B"))
    return out


def _floor_save(views: list[memoryview], path: str, direct: bool = False) -> bool:
    """What any writer of these bytes pays on this machine: one file per rank, written
    in order, fsynced with its directory (the durability both systems give). With
    `direct` (one aligned buffer), written around the page cache (`storage.direct_io`);
    returns whether the filesystem took it so."""
    from relight.storage.direct_io import write_file

    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    went_direct = False
    try:
        for v in views:
            went_direct |= write_file(fd, v, direct)
        os.fsync(fd)
    finally:
        os.close(fd)
    dfd = os.open(os.path.dirname(path), os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return went_direct


def _drop_all_caches() -> None:
    """Empty the whole page cache, dentries and inodes included (root only)."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def _same(got: dict, want: dict) -> bool:
    """Whether every tensor of `got` equals `want`'s bitwise (local shards)."""
    import torch

    from relight.ckpt.flatten import flatten_state

    a, b = flatten_state(got).tensors, flatten_state(want).tensors
    for name, ref in b.items():
        x, y = a[name].tensor, ref.tensor
        x = x.to_local() if hasattr(x, "to_local") else x
        y = y.to_local() if hasattr(y, "to_local") else y
        if not torch.equal(x.view(torch.uint8), y.view(torch.uint8)):
            return False
    return True


def _evict(root: str) -> None:
    """Drop every file under `root` from the page cache (its pages are clean: every
    writer fsynced them), so the next read comes from the device, as a resumed job's
    does on a node that did not write the checkpoint."""
    files = [root] if os.path.isfile(root) else [
        os.path.join(dirpath, name) for dirpath, _dirs, names in os.walk(root) for name in names]
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _floor_load(views: list[memoryview], path: str) -> None:
    """Read that file back straight into the rank's (preallocated) tensors."""
    fd = os.open(path, os.O_RDONLY)
    try:
        at = 0
        for v in views:
            got = 0
            while got < len(v):
                n = os.preadv(fd, [v[got:]], at + got)
                if n <= 0:
                    raise OSError(f"{path}: short read at {at + got}")
                got += n
            at += len(v)
    finally:
        os.close(fd)


def _worker(rank: int, world: int, init: str, args: dict, out_q: Any) -> None:
    os.environ.update(args["env"])
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard

    from relight import ckpt, storage

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))
    mesh = DeviceMesh("cpu", torch.arange(world))
    mesh2 = DeviceMesh("cpu", torch.arange(world).reshape(2, world // 2))
    n, rows = _layers(args["mb"], world, args["layers"])
    make_state = functools.partial(_state, biases=args["biases"])
    first_suffix = "-sync" if args["load_from"] == "sync" else "-async"
    """The checkpoint the same-layout load reads (`--load-from`)."""
    src = make_state(mesh, n, rows, [Shard(0)], [Shard(0)], True)
    sampler = RssSampler()
    base = args["base"]
    s3 = args["storage"] == "s3"
    if s3:
        _count_s3fs_reads()
    results: dict[str, dict[str, list[float]]] = {"relight": {}, "dcp": {}, "floor": {}}
    extra: dict[str, list[float]] = {}
    peak = {"relight": 0, "dcp": 0, "floor": 0}
    bitwise: list[bool] = []
    """Whether each load checked gave back the saved state bit for bit (every
    same-layout load, the first round's resharded loads)."""

    def win(system: str, on: bool) -> None:
        """Extra memory a phase needs: peak RSS during it minus RSS when it started
        (targets are allocated before the window opens)."""
        if on:
            sampler.window(True)
            win.start = sampler.proc.memory_info().rss  # type: ignore[attr-defined]
        else:
            sampler.window(False)
            peak[system] = max(peak[system], sampler.peak - win.start)  # type: ignore

    def rec(system: str, key: str, value: float) -> None:
        results[system].setdefault(key, []).append(value)

    def timed(fn, system: str, reads: str | None = None) -> float:  # noqa: ANN001
        """Seconds of `fn` on the slowest rank. `reads`: the files a load reads, dropped
        from the page cache first under `--load-cache cold` (then `--cold-settle-s`)."""
        if reads is not None and not s3 and args["load_cache"] in ("cold", "dropped"):
            if rank == 0:
                if args["load_cache"] == "dropped":
                    _drop_all_caches()
                else:
                    _evict(reads)
            # A job resumed on another node finds neither the checkpoint's pages nor
            # pages freed a moment ago: the evicted pages get cold_settle_s to go back
            # to the free pool before the load (see the module docstring).
            dist.barrier()
            time.sleep(args["cold_settle_s"])
        dist.barrier()
        win(system, True)
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        win(system, False)
        t = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    step_a = torch.randn(256, 256)

    def train_step() -> float:
        """The training-step stand-in (see step_s in the module docstring): seconds."""
        t0 = time.perf_counter()
        for _ in range(args["step_iters"]):
            torch.mm(step_a, step_a)
        return time.perf_counter() - t0

    def maxed(x: float) -> float:
        t = torch.tensor([x])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    def summed(x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t)

    def dcp_writer(path: str):  # noqa: ANN202
        if s3:
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

            return FsspecWriter(path, client_kwargs={"endpoint_url": args["env"]
                                                     ["AWS_ENDPOINT_URL"]})
        return dcp.FileSystemWriter(path)

    def dcp_reader(path: str):  # noqa: ANN202
        if s3:
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

            return FsspecReader(path, client_kwargs={"endpoint_url": args["env"]
                                                     ["AWS_ENDPOINT_URL"]})
        return dcp.FileSystemReader(path)

    def check_reshard(got: dict, r: int) -> None:
        """The resharded load bit for bit, in the first round (the expected shards are
        generated again from the seeds: seconds of CPU, so once per system)."""
        if r == 0:
            want = make_state(mesh2, n, rows, [Shard(0), Shard(1)], [Shard(0), Replicate()],
                              True)
            bitwise.append(_same(got, want))

    def remove_round(system: str, gone: int) -> None:
        if not s3 and gone >= 0:
            if rank == 0:
                import glob
                import shutil

                for old in glob.glob(f"{base}/{system}-{gone}*"):
                    shutil.rmtree(old, ignore_errors=True)
            dist.barrier()

    def run_arm(system: str, r: int) -> None:
        # fresh: each system's saves start from the same page cache: its previous
        # round's checkpoints are removed first (their pages freed); a save's time then
        # depends on the writer, not on how many earlier pages the kernel must reclaim.
        # kept: as a run's retention does (`keep_last=3` right after a commit), the
        # round KEPT_ROUNDS back goes once this round's saves are done.
        if args["condition"] == "fresh":
            remove_round(system, r - 1)
        run_system(system, r)
        if args["condition"] == "kept":
            remove_round(system, r - KEPT_ROUNDS)
        # The training between a run's saves: no checkpoint I/O for train_gap_s, so
        # what this arm freed is back in the free pool when the next arm starts, as
        # it is when a run's next save comes (see the module docstring).
        dist.barrier()
        time.sleep(args["train_gap_s"])
        dist.barrier()

    def run_system(system: str, r: int) -> None:
        url = f"{base}/{system}-{r}"
        if system == "relight":
            opts = ckpt.SaveOptions(compression=args["compression"])
            store = storage.open_store(url + "-sync")
            rec(system, "save_s", timed(lambda: ckpt.save(src, store, options=opts), system))
            h_box = {}

            def start() -> None:
                h_box["h"] = ckpt.save(src, url + "-async", async_save=True, options=opts)
            dist.barrier()
            win(system, True)
            t0 = time.perf_counter()
            start()
            stall = time.perf_counter() - t0
            step = train_step()
            h_box["h"].wait()
            dist.barrier()
            total = time.perf_counter() - t0
            win(system, False)
            rec(system, "stall_s", maxed(stall))
            rec(system, "async_total_s", maxed(total))
            if args["step_iters"]:
                rec(system, "step_s", maxed(step))
            extra.setdefault("relight_stall_staging_copy_s", []).append(
                maxed(h_box["h"].stage_s))
            same = make_state(mesh, n, rows, [Shard(0)], [Shard(0)], False)
            newest = storage.open_store(url + "-async")  # the other loads read the newest
            first = storage.open_store(url + first_suffix)
            before = first.stats.snapshot()
            rec(system, "load_s", timed(lambda: ckpt.load(same, first), system,
                                        first.location.root))
            after = first.stats.snapshot()
            bitwise.append(_same(same, src))
            extra.setdefault("relight_load_cached_share", []).append(
                summed(after["bytes_read_cached"] - before["bytes_read_cached"])
                / max(1.0, summed(after["bytes_read"] - before["bytes_read"])))
            del same
            tgt = make_state(mesh2, n, rows, [Shard(0), Shard(1)], [Shard(0), Replicate()], False)
            c0, s0 = _bytes_read_now(s3), newest.stats.snapshot()
            rec(system, "reshard_load_s",
                timed(lambda: ckpt.load(tgt, newest), system, url + "-async"))
            s1 = newest.stats.snapshot()
            chunk_bytes = summed(s1["bytes_read"] - s0["bytes_read"])
            extra.setdefault("relight_reshard_reads", []).append(summed(s1["reads"] - s0["reads"]))
            # rchar counts read()/pread() only: Relight's mapped reads of cached pages
            # would count as nothing; its store counts every byte it hands over.
            rec(system, "bytes_read_reshard",
                chunk_bytes if system == "relight" and not s3
                else summed(_bytes_read_now(s3) - c0))
            check_reshard(tgt, r)
            extra.setdefault("relight_reshard_chunk_bytes", []).append(chunk_bytes)
            del tgt
            rep = make_state(mesh2, n, rows, [Replicate(), Shard(1)], [Replicate(), Replicate()],
                         False)
            extra.setdefault("relight_replicated_load_broadcast_s", []).append(
                timed(lambda: ckpt.load(rep, newest, broadcast=True), system, url + "-async"))
            extra.setdefault("relight_replicated_load_direct_s", []).append(
                timed(lambda: ckpt.load(rep, newest, broadcast=False), system,
                      url + "-async"))
            del rep
            # Pipelined staging (after the loads, so they find the same dirty page cache as
            # DCP's loads do): save() returns once the copy is scheduled; the state may
            # be changed once wait_staged() returns (measured with no compute between).
            popts = ckpt.SaveOptions(compression=args["compression"], pipelined_staging=True)
            dist.barrier()
            win(system, True)
            t0 = time.perf_counter()
            h = ckpt.save(src, url + "-pipelined", async_save=True, options=popts)
            ret = time.perf_counter() - t0
            h.wait_staged()
            staged = time.perf_counter() - t0
            h.wait()
            dist.barrier()
            total = time.perf_counter() - t0
            win(system, False)
            rec(system, "pipelined_return_s", maxed(ret))
            rec(system, "pipelined_staged_s", maxed(staged))
            rec(system, "pipelined_total_s", maxed(total))
            if rank == 0:
                nb, objs = _prefix_bytes(url + "-sync")
                extra.setdefault("relight_objects", []).append(objs)
            else:
                nb = 0
            rec(system, "bytes_written", summed(nb))
            bufs = ckpt.default_checkpointer().cached.bufs
            staged = bufs.staging.numel() if bufs.staging is not None else 0
            extra.setdefault("relight_staging_over_shard_bytes", []).append(
                maxed(staged / (3 * rows * (HIDDEN + args["biases"]) * 4 * n / world)))
        elif system == "floor":
            # The machine's floor for the same bytes, no checkpoint format at all: one
            # object per rank (a file written and fsynced; on S3 one PUT of the bytes,
            # joined beforehand), read back into the tensors, and the staging copy into
            # a preallocated buffer.
            views = _local_bytes(src)
            same = make_state(mesh, n, rows, [Shard(0)], [Shard(0)], False)
            dst = _local_bytes(same)
            staging = [torch.empty(len(v), dtype=torch.uint8) for v in views]
            srcs = [torch.frombuffer(v, dtype=torch.uint8) for v in views]

            def copy() -> None:
                for d, s in zip(staging, srcs, strict=True):
                    d.copy_(s)
            copy()  # the buffers are reused across saves, as both systems' are
            if s3:
                store = storage.open_store(url)
                key = f"r{rank:05d}.bin"
                blob = b"".join(views)
                rec(system, "save_s", timed(lambda: store.put(key, blob), system))
                del blob
                rec(system, "stall_s", timed(copy, system))

                def load_s3() -> None:
                    data, at = memoryview(store.get(key)), 0
                    for v in dst:
                        v[:] = data[at: at + len(v)]
                        at += len(v)
                rec(system, "load_s", timed(load_s3, system))
            else:
                path = os.path.join(url, f"r{rank:05d}.bin")
                rec(system, "save_s", timed(lambda: _floor_save(views, path), system))
                # The copy right after a save, where both systems' async saves come.
                rec(system, "stall_s", timed(copy, system))
                # The same bytes around the page cache: one aligned buffer, joined
                # beforehand as the S3 floor's blob is.
                from relight.storage.direct_io import aligned_empty

                blob = aligned_empty(sum(len(v) for v in views))
                at = 0
                for v in views:
                    blob[at: at + len(v)] = np.frombuffer(v, dtype=np.uint8)
                    at += len(v)
                went = [False]

                def save_direct() -> None:
                    went[0] = _floor_save([memoryview(blob)], path + ".direct", direct=True)
                rec(system, "save_direct_s", timed(save_direct, system))
                extra.setdefault("floor_direct_io_taken", []).append(maxed(float(went[0])))
                del blob
                rec(system, "load_s", timed(lambda: _floor_load(dst, path), system, url))
            del same, dst
            if args["step_iters"]:  # the training step with no save beside it
                dist.barrier()
                rec(system, "step_s", maxed(train_step()))
            # The same copy after the loads, away from any write (supporting figure).
            extra.setdefault("floor_copy_after_loads_s", []).append(timed(copy, system))
            del staging, srcs
        else:
            rec(system, "save_s", timed(
                lambda: dcp.save(src, storage_writer=dcp_writer(url + "-sync")), system))
            path = url + "-async"  # the loads read the newest checkpoint
            dist.barrier()
            win(system, True)
            t0 = time.perf_counter()
            fut = dcp.async_save(src, storage_writer=dcp_writer(url + "-async"))
            stall = time.perf_counter() - t0
            step = train_step()
            (fut.upload_completion if hasattr(fut, "upload_completion") else fut).result()
            dist.barrier()
            total = time.perf_counter() - t0
            win(system, False)
            rec(system, "stall_s", maxed(stall))
            rec(system, "async_total_s", maxed(total))
            if args["step_iters"]:
                rec(system, "step_s", maxed(step))
            same = make_state(mesh, n, rows, [Shard(0)], [Shard(0)], False)
            first = url + first_suffix
            rec(system, "load_s", timed(lambda: dcp.load(same, storage_reader=dcp_reader(first)),
                                        system, first))
            bitwise.append(_same(same, src))
            del same
            tgt = make_state(mesh2, n, rows, [Shard(0), Shard(1)], [Shard(0), Replicate()], False)
            c0 = _bytes_read_now(s3)
            rec(system, "reshard_load_s",
                timed(lambda: dcp.load(tgt, storage_reader=dcp_reader(path)), system, path))
            rec(system, "bytes_read_reshard", summed(_bytes_read_now(s3) - c0))
            check_reshard(tgt, r)
            del tgt
            rep = make_state(mesh2, n, rows, [Replicate(), Shard(1)], [Replicate(), Replicate()],
                         False)
            extra.setdefault("dcp_replicated_load_s", []).append(
                timed(lambda: dcp.load(rep, storage_reader=dcp_reader(path)), system, path))
            del rep
            nb = _prefix_bytes(path)[0] if rank == 0 else 0
            rec(system, "bytes_written", summed(nb))

    for r in range(args["rounds"]):
        order = ["dcp", "relight"] if r % 2 == 0 else ["relight", "dcp"]
        order.append("floor")
        for system in order:
            run_arm(system, r)
            if rank == 0:
                print(f"round {r} {system}: " + ", ".join(
                    f"{k}={v[-1]:.3f}" for k, v in results[system].items()), flush=True)
    for system in peak:
        results[system]["peak_rss_mb"] = [maxed(peak[system] / 2**20)]
    sampler.stop = True
    all_equal = maxed(float(not all(bitwise))) == 0
    if rank == 0:
        out_q.put({"results": results, "extra": extra, "layers": n, "rows": rows,
                   "bitwise": all_equal})
    dist.destroy_process_group()


RESULT_TIMEOUT_S = 3600.0
"""How long the parent waits for rank 0's results while every worker is alive."""


class WorkerDiedError(RuntimeError):
    """A benchmark worker exited before rank 0 reported the results."""

    def __init__(self, msg: str, exit_code: int) -> None:
        super().__init__(msg)
        self.exit_code = exit_code
        """The first failed worker's exit status as a shell reports it (128 + N when
        signal N killed it)."""


def _result(q: Any, procs: list[Any], timeout_s: float, poll_s: float = 0.5) -> Any:
    """Rank 0's results from `q`. Fails fast, naming the rank and its exit code, when a
    worker exits without them (a crash leaves the others blocked in a collective, and
    the parent would otherwise wait out `timeout_s`)."""
    import queue

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return q.get(timeout=poll_s)
        except queue.Empty:
            pass
        dead = [(r, pr.exitcode) for r, pr in enumerate(procs) if pr.exitcode is not None]
        failed = [(r, code) for r, code in dead if code != 0]
        if failed or len(dead) == len(procs):
            if not failed:  # every worker exited cleanly: the results may be in flight
                try:
                    return q.get(timeout=5)
                except queue.Empty:
                    pass
            shown = failed or dead
            code = shown[0][1]
            raise WorkerDiedError(
                "benchmark worker(s) exited before reporting: " + ", ".join(
                    f"rank {r} with exit code {c}" for r, c in shown)
                + "; see the worker's traceback above", 128 - code if code < 0 else code or 1)
        if time.monotonic() > deadline:
            raise TimeoutError(f"no benchmark results after {timeout_s:.0f} s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=int, default=512)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--storage", choices=["file", "s3"], default="file")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default=None, help="where file checkpoints go (default: a temp dir)")
    p.add_argument("--compression", choices=["none", "zstd"], default="none")
    p.add_argument("--condition", choices=["kept", "fresh"], default="kept",
                   help="files: keep earlier rounds' checkpoints on disk, as a run does "
                        "(kept), or delete each system's previous round first (fresh)")
    p.add_argument("--load-cache", choices=["cold", "as-saved", "dropped"], default="cold",
                   help="files: drop each checkpoint from the page cache before every "
                        "load, as a resumed job on another node reads it (cold), load "
                        "with whatever the save left cached (as-saved), or empty the "
                        "whole page cache, dentries and inodes first (dropped; root only)")
    p.add_argument("--load-from", choices=["newest", "sync"], default="newest",
                   help="the checkpoint the same-layout load reads: the newest (the async "
                        "save's) or the sync save's, made just before it")
    p.add_argument("--layers", type=int, default=None,
                   help="weight matrices in the state (default: one per 48 MiB)")
    p.add_argument("--no-biases", dest="biases", action="store_false",
                   help="leave out the biases and their moments (only the matrices)")
    p.add_argument("--train-gap-s", type=float, default=5.0,
                   help="seconds without checkpoint I/O after every arm, standing in for "
                        "the training between a run's saves (0: arms back to back)")
    p.add_argument("--cold-settle-s", type=float, default=5.0,
                   help="files, cold loads: seconds between dropping a checkpoint from the "
                        "page cache and loading it (0: load at once)")
    p.add_argument("--step-iters", type=int, default=200,
                   help="matmuls of the training-step stand-in run right after each async "
                        "save returns (0: none)")
    p.add_argument("--json", dest="json_out", default=None)
    a = p.parse_args(argv)
    if a.load_cache == "dropped" and os.geteuid() != 0:
        p.error("--load-cache dropped writes /proc/sys/vm/drop_caches: run as root")
    if a.ranks % 2:
        p.error("--ranks must be even (the reshard target is dp2 x tp(ranks/2))")
    import torch.multiprocessing as mp

    server = None
    env: dict[str, str] = {}
    tmp = tempfile.mkdtemp(prefix="bench-ckpt-", dir=a.dir)
    if a.storage == "s3":
        from relight.chaos.s3_server import S3Server

        server = S3Server(os.path.join(tmp, "s3")).start()
        env = server.env()
        base = server.url(f"bench-{uuid.uuid4().hex[:8]}")
        os.environ.update(env)
    else:
        base = os.path.join(tmp, "ck")
    args = {"mb": a.mb, "storage": a.storage, "rounds": a.rounds, "base": base, "env": env,
            "condition": a.condition, "load_cache": a.load_cache,
            "load_from": a.load_from, "layers": a.layers, "biases": a.biases,
            "train_gap_s": a.train_gap_s, "cold_settle_s": a.cold_settle_s,
            "step_iters": a.step_iters,
            "compression": None if a.compression == "none" else a.compression}
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    init = f"file://{tmp}/rdzv"
    procs = [ctx.Process(target=_worker, args=(r, a.ranks, init, args, q))
             for r in range(a.ranks)]
    try:
        for pr in procs:
            pr.start()
        try:
            got = _result(q, procs, RESULT_TIMEOUT_S)
        except WorkerDiedError as e:
            print(f"error: {e}", file=sys.stderr)
            return e.exit_code
        for pr in procs:
            pr.join(timeout=60)
    finally:
        for pr in procs:
            if pr.is_alive():
                pr.kill()
        if server is not None:
            server.stop()
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    fields = ["stall_s", "async_total_s", "save_s", "load_s", "reshard_load_s",
              "bytes_written", "bytes_read_reshard", "peak_rss_mb"]
    if a.step_iters:
        fields.append("step_s")
    out: dict[str, Any] = {}
    for system in ("relight", "dcp"):
        out[system] = {f: statistics.median(got["results"][system][f]) for f in fields}
    # Ratios per round (the two systems ran back to back), then the median over rounds:
    # robust to load on the machine drifting between rounds.
    per_round = {
        f: [d / r for d, r in zip(got["results"]["dcp"][f], got["results"]["relight"][f],
                                  strict=True) if r > 0]
        for f in fields if f.endswith("_s")
    }
    out["ratios"] = {f: statistics.median(v) for f, v in per_round.items() if v}
    # Relight's pipelined staging against DCP's async_save (stall / total).
    dcp_r = got["results"]["dcp"]
    for f, base in (("pipelined_return_s", "stall_s"), ("pipelined_staged_s", "stall_s"),
                    ("pipelined_total_s", "async_total_s")):
        rl = got["results"]["relight"][f]
        per_round[f] = [d / r for d, r in zip(dcp_r[base], rl, strict=True) if r > 0]
        out["ratios"][f"{base}_vs_{f}"] = statistics.median(per_round[f])
        out["relight"][f] = statistics.median(rl)
    # The floor: the same bytes with no format, in the same rounds.
    # floor/system per round, median: 1.0 means the system runs at the machine's floor.
    fl = got["results"].get("floor", {})
    if fl.get("save_s"):
        out["floor"] = {f: statistics.median(v) for f, v in fl.items() if f.endswith("_s")}
        out["floor_ratios"] = {
            f"{system}_{f}": statistics.median(
                [x / y for x, y in zip(fl[f], got["results"][system][f], strict=True) if y > 0])
            for system in ("relight", "dcp") for f in ("save_s", "load_s", "stall_s", "step_s")
            if fl.get(f)}
        if fl.get("save_direct_s"):  # files: the same bytes written around the page cache
            out["floor_ratios"].update({
                f"{system}_save_s_direct": statistics.median(
                    [x / y for x, y in zip(fl["save_direct_s"], got["results"][system]["save_s"],
                                           strict=True) if y > 0])
                for system in ("relight", "dcp")})
    out["loads_bitwise_equal"] = got["bitwise"]
    out["extra"] = {"ratios_per_round": per_round}
    out["extra"].update({k: statistics.median(v) for k, v in got["extra"].items()})
    out["extra"]["all_rounds"] = got["results"]
    out["config"] = {"mb": a.mb, "ranks": a.ranks, "storage": a.storage, "rounds": a.rounds,
                     "layers": got["layers"], "rows": got["rows"], "hidden": HIDDEN,
                     "compression": a.compression, "condition": a.condition,
                     "load_cache": a.load_cache, "load_from": a.load_from,
                     "biases": a.biases, "train_gap_s": a.train_gap_s,
                     "cold_settle_s": a.cold_settle_s, "step_iters": a.step_iters,
                     "cpus": os.cpu_count(),
                     "loadavg_after": os.getloadavg(),
                     "command": "python -m relight.benchmarks.ckpt "
                     + " ".join(argv or sys.argv[1:])}
    text = json.dumps(out, indent=1)
    if a.json_out:
        with open(a.json_out, "w") as f:
            f.write(text)
    print(json.dumps({k: out[k] for k in ("relight", "dcp", "ratios", "floor", "floor_ratios",
                                          "loads_bitwise_equal")
                      if k in out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
