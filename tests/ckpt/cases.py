"""Test cases run inside the rank pool (see _pool.py). Every function runs on every
rank of the pool; arguments and results are JSON-able."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from relight import ckpt, storage
from relight.storage.testing import FaultPlan, FaultyStore

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "int64": torch.int64}


def _placement(code: str):
    if code == "R":
        return Replicate()
    if code.startswith("SS"):
        dim, sf = code[2:].split(":")
        return _StridedShard(int(dim), split_factor=int(sf))
    return Shard(int(code[1:]))


@functools.cache
def _group(n: int):
    """Process group of ranks 0..n-1 (all ranks must call, in the same order)."""
    world = dist.get_world_size()
    if n == world:
        return None
    return dist.new_group(list(range(n)))


@functools.cache
def _mesh(shape: tuple[int, ...]) -> DeviceMesh:
    n = 1
    for s in shape:
        n *= s
    # No process groups for the mesh: cases build DTensors from every rank's full copy
    # (src_data_rank=None) and the engine uses its own group, so none are needed.
    return DeviceMesh("cpu", torch.arange(n).reshape(shape), _init_backend=False)


def prepare(sizes: list[int], meshes: list[list[int]]) -> bool:
    """Create groups and meshes up front, in the same order on every rank."""
    for n in sizes:
        _group(n)
    for m in meshes:
        _mesh(tuple(m))
    return True


def global_tensor(spec: dict[str, Any], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    dt = DTYPES[spec["dtype"]]
    shape = tuple(spec["shape"])
    if dt == torch.int64:
        return torch.randint(-(2**40), 2**40, shape, generator=g, dtype=torch.int64)
    return torch.randn(shape, generator=g).to(dt)


def _agreed(fn, group):  # noqa: ANN001, ANN202
    """Run fn; if it fails on any rank of `group`, raise on all of them (so a harness
    problem on one rank never leaves the others in a collective of the next case)."""
    err = None
    try:
        value = fn()
    except Exception as e:  # noqa: BLE001
        err, value = e, None
    flags = [None] * dist.get_world_size(group)
    dist.all_gather_object(flags, err is not None, group=group)
    if err is not None:
        raise err
    if any(flags):
        raise RuntimeError("another rank failed to build the case")
    return value


def _world_of(mesh: list[int]) -> int:
    n = 1
    for s in mesh:
        n *= s
    return n


def build(tensors: list[dict[str, Any]], mesh: list[int], placements: list[list[str]],
          seed: int, zeros: bool = False) -> dict[str, Any]:
    dm = _mesh(tuple(mesh))
    sd: dict[str, Any] = {}
    for i, (spec, pl) in enumerate(zip(tensors, placements, strict=True)):
        full = global_tensor(spec, seed + i)
        if zeros:
            full = torch.zeros_like(full)
        if pl == ["plain"]:
            sd[spec["name"]] = full
        else:
            sd[spec["name"]] = distribute_tensor(full, dm, [_placement(p) for p in pl],
                                                 src_data_rank=None)
    return sd


def save_load(url: str, tensors: list[dict[str, Any]], seed: int,
              save_mesh: list[int], save_pl: list[list[str]],
              load_mesh: list[int], load_pl: list[list[str]],
              async_save: bool = False, broadcast: bool = True,
              values: dict[str, Any] | None = None, options: dict[str, Any] | None = None,
              env: dict[str, str] | None = None) -> dict[str, Any]:
    os.environ.update(env or {})
    rank = dist.get_rank()
    out: dict[str, Any] = {"rank": rank}
    ws, wl = _world_of(save_mesh), _world_of(load_mesh)
    store = storage.open_store(url)
    if rank < ws:
        sd = _agreed(lambda: build(tensors, save_mesh, save_pl, seed), _group(ws))
        if values:
            sd["values"] = dict(values)
        h = ckpt.save(sd, store, async_save=async_save, process_group=_group(ws),
                      options=ckpt.SaveOptions(**(options or {})), step=seed)
        h.wait()
        out["bytes_written"] = h.bytes_written
    dist.barrier()
    if rank < wl:
        target = build(tensors, load_mesh, load_pl, seed, zeros=True)
        if values:
            target["values"] = None
        before = store.stats.snapshot()["bytes_read"]
        info = ckpt.load(target, store, process_group=_group(wl), broadcast=broadcast)
        out["bytes_read"] = store.stats.snapshot()["bytes_read"] - before
        out["bytes_needed"] = info.bytes_needed
        out["bytes_read_info"] = info.bytes_read
        expected = build(tensors, load_mesh, load_pl, seed)
        bad = []
        for spec in tensors:
            a, b = target[spec["name"]], expected[spec["name"]]
            if isinstance(a, DTensor):
                a, b = a.to_local(), b.to_local()
            if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(
                    a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)):
                bad.append(spec["name"])
        out["mismatch"] = bad
        if values:
            out["values_ok"] = target["values"] == json.loads(json.dumps(values))
    dist.barrier()
    return out


def manager_save(root: str, steps: list[int], tensors: list[dict[str, Any]],
                 mesh: list[int], pl: list[list[str]], keep_last: int = 2,
                 fail_after_persist_rank: int | None = None) -> dict[str, Any]:
    ws = _world_of(mesh)
    if dist.get_rank() >= ws:
        return {}
    mgr = ckpt.CheckpointManager(root, keep_last=keep_last, process_group=_group(ws))
    for s in steps:
        sd = build(tensors, mesh, pl, s)
        sd["step"] = s
        mgr.save(s, sd, async_save=True)
    mgr.wait()
    return {"latest": mgr.latest_step(), "steps": mgr.committed_steps()}


def manager_restore(root: str, tensors: list[dict[str, Any]], mesh: list[int],
                    pl: list[list[str]]) -> dict[str, Any]:
    ws = _world_of(mesh)
    if dist.get_rank() >= ws:
        return {}
    mgr = ckpt.CheckpointManager(root, process_group=_group(ws))
    sd = build(tensors, mesh, pl, 0, zeros=True)
    sd["step"] = -1
    step = mgr.restore(sd)
    expected = build(tensors, mesh, pl, step)
    ok = all(torch.equal(sd[t["name"]].to_local() if isinstance(sd[t["name"]], DTensor)
                         else sd[t["name"]],
                         expected[t["name"]].to_local() if isinstance(expected[t["name"]], DTensor)
                         else expected[t["name"]]) for t in tensors)
    return {"step": step, "value": sd["step"], "ok": ok}


def restore_listing_fails_on_coordinator(root: str) -> dict[str, Any]:
    """Only the coordinator lists for a restore; when its listing fails (S3 down past
    the retry budget), every rank must raise at once instead of waiting in a gather."""
    store = storage.open_store(root)
    if dist.get_rank() == 0:
        store = FaultyStore(store, FaultPlan(
            fail_fraction=1.0, fail_times=100, ops=("list",)))
        store.retry = storage.RetryPolicy(max_attempts=2, base_delay_s=0.0, max_delay_s=0.0)
    mgr = ckpt.CheckpointManager(store)
    try:
        mgr.restore({"w": torch.zeros(4)})
    except OSError as e:
        return {"raised": type(e).__name__, "storage": isinstance(e, storage.StorageError)}
    return {"raised": None}


def crash_save(root: str, tensors: list[dict[str, Any]], mesh: list[int],
               pl: list[list[str]], victim: int, where: str, timeout_s: float) -> dict[str, Any]:
    """Commit step 1, then save step 2 during which `victim` is SIGKILLed: in the middle
    of persisting ("persist") or, as coordinator, right before the marker ("commit").
    Survivors must see the save fail."""
    import relight.ckpt.writer as eng

    rank = dist.get_rank()
    opts = ckpt.SaveOptions(commit_timeout_s=timeout_s)
    mgr = ckpt.CheckpointManager(root, keep_last=3, options=opts)
    mgr.save(1, build(tensors, mesh, pl, 1), async_save=False)
    if rank == victim:
        if where == "persist":
            real = eng._SaveJob.persist

            def persist(self):  # noqa: ANN001
                real(self)  # this rank's arrays are written, its index is not
                os.kill(os.getpid(), signal.SIGKILL)

            eng._SaveJob.persist = persist
        else:
            def manifest(self, indexes):  # noqa: ANN001
                os.kill(os.getpid(), signal.SIGKILL)

            eng._SaveJob._manifest = manifest
    h = mgr.save(2, build(tensors, mesh, pl, 2), async_save=True)
    t0 = time.monotonic()
    try:
        h.wait()
        return {"failed": False}
    except ckpt.CheckpointSaveError as e:
        return {"failed": True, "error": str(e), "waited": time.monotonic() - t0}


def log_setup() -> bool:
    logging.basicConfig(level=logging.WARNING,
                        format=f"%(asctime)s r{dist.get_rank()} %(name)s %(message)s")
    return True


def collectives_stay_in_foreground(root: str) -> dict[str, Any]:
    """Record the thread of every collective/p2p call made during async saves."""
    import threading

    seen: list[str] = []
    names = ["all_gather", "all_gather_into_tensor", "all_reduce", "broadcast", "barrier",
             "isend", "irecv", "send", "recv", "all_gather_object", "gather", "scatter"]
    real = {n: getattr(dist, n) for n in names}

    def wrap(fn):  # noqa: ANN001, ANN202
        def inner(*a, **kw):  # noqa: ANN002, ANN003, ANN202
            seen.append(threading.current_thread().name)
            return fn(*a, **kw)
        return inner

    for n in names:
        setattr(dist, n, wrap(real[n]))
    try:
        tensors = [{"name": "w", "shape": [64, 48], "dtype": "float32"},
                   {"name": "b", "shape": [48], "dtype": "bfloat16"}]
        mgr = ckpt.CheckpointManager(root, keep_last=2)
        for step in range(3):
            mgr.save(step, build(tensors, [4], [["S0"], ["R"]], step), async_save=True)
        mgr.wait()
        latest = mgr.latest_step()
    finally:
        for n in names:
            setattr(dist, n, real[n])
    return {"threads": sorted(set(seen)), "calls": len(seen), "latest": latest}


def save_on_one_rank_only(url: str, timeout_s: float) -> dict[str, Any]:
    """A DDP habit: `save` on rank 0 only. Its group ({0, 1}, made for this case and
    dropped after it) never completes the handshake: rank 0 must get an error that says
    what it waited for and that every rank must call, within `timeout_s`."""
    from datetime import timedelta

    group = dist.new_group([0, 1], timeout=timedelta(seconds=timeout_s))  # every rank calls
    if dist.get_rank() != 0:
        return {}
    t0 = time.monotonic()
    try:
        ckpt.save({"w": torch.zeros(8)}, url, process_group=group,
                  options=ckpt.SaveOptions(collective_timeout_s=timeout_s))
    except ckpt.CollectiveError as e:
        return {"error": str(e), "waited": time.monotonic() - t0,
                "runtime_error": isinstance(e, RuntimeError)}
    return {"error": None}


def async_staging_fails_on_one_rank(url: str, failing: int) -> dict[str, Any]:
    """Async saves whose staging copy fails on rank `failing`: every rank's `save()`
    must raise (no background persist starts, no coordinator waits for the rank's
    index), and the next save of the same state commits. Twice: on a new plan (the
    copy, then an all-gather) and on the cached plan (the copy before the handshake)."""
    from relight import ckpt

    real = ckpt.saver.Stager.run

    def broken(self):  # noqa: ANN001, ANN202
        raise RuntimeError("staging copy failed (injected)")

    state = build([{"name": "w", "shape": [64, 48], "dtype": "float32"}], [4], [["S0"]], 1)
    ckpt.default_checkpointer().cached = None  # the first failure meets a new plan
    errors, committed = [], []
    for attempt in range(2):
        target = f"{url}/{attempt}"
        if dist.get_rank() == failing:
            ckpt.saver.Stager.run = broken
        try:
            ckpt.save(state, target, async_save=True)
            errors.append(None)
        except Exception as e:  # noqa: BLE001 - returned to the test
            errors.append(f"{type(e).__name__}: {e}")
        finally:
            ckpt.saver.Stager.run = real
        ckpt.save(state, target, async_save=True).wait()
        committed.append(storage.open_store(target).exists("COMMIT"))
    return {"errors": errors, "committed": committed}


def gather_to_coordinator(payloads: list[str]) -> dict[str, Any]:
    """`Comm.gather_bytes` and `gather_or_raise`: payloads of different sizes (one
    empty) reach the coordinator in group order, and no other rank."""
    from relight.ckpt.collective import gather_or_raise
    from relight.ckpt.comm import Comm

    comm = Comm(None, timeout_s=60)
    mine = payloads[dist.get_rank()].encode()
    lens = [len(p.encode()) for p in payloads]
    raw = comm.gather_bytes(mine, lens)
    docs = gather_or_raise(comm, None, {"rank": dist.get_rank(), "p": payloads[dist.get_rank()]})
    return {"raw": None if raw is None else [b.decode() for b in raw], "docs": docs}


def sync_save_fails_on_one_rank(url: str, failing: int) -> dict[str, Any]:
    """A synchronous save whose persist fails on rank `failing`: every rank's `save()`
    raises an error naming that rank and nothing is committed; the next save of the same
    state to the same URL commits (the indexes reach the coordinator) and loads bitwise."""
    from relight import ckpt

    real = ckpt.writer._SaveJob.persist

    def broken(self):  # noqa: ANN001, ANN202
        raise storage.StorageError("the disk is full (injected)", url=url)

    spec = [{"name": "w", "shape": [64, 48], "dtype": "float32"}]
    state = build(spec, [4], [["S0"]], 3)
    state["values"] = {"rank_of_writer": 0}
    if dist.get_rank() == failing:
        ckpt.writer._SaveJob.persist = broken
    try:
        ckpt.save(state, url, async_save=False)
        error = None
    except Exception as e:  # noqa: BLE001 - returned to the test
        error = f"{type(e).__name__}: {e}"
    finally:
        ckpt.writer._SaveJob.persist = real
    committed_after_failure = storage.open_store(url).exists("COMMIT")
    dist.barrier()
    ckpt.save(state, url, async_save=False)
    target = build(spec, [4], [["S0"]], 3, zeros=True)
    target["values"] = None
    ckpt.load(target, url)
    same = torch.equal(target["w"].to_local(), state["w"].to_local())
    return {"error": error, "committed_after_failure": committed_after_failure,
            "loaded_equal": same, "values": target["values"]}


def grid_forms(mesh: list[int], cases: list[dict[str, Any]]) -> list[Any]:
    """For each {shape, pl}: the closed form `ckpt.layout.mesh_grid` finds for this rank's
    DTensor (its JSON, or None), and whether that grid gives exactly its pieces."""
    from relight.ckpt.layout import local_pieces, mesh_grid

    out = []
    for i, case in enumerate(cases):
        t = build([{"name": "t", "shape": case["shape"], "dtype": "float32"}], mesh,
                  [case["pl"]], i)["t"]
        _, pieces = local_pieces(t, "t")
        boxes = tuple((p.offset, p.shape) for p in pieces)
        grid = mesh_grid(t, dist.get_rank(), boxes)
        coord = tuple(t.device_mesh.get_coordinate())
        out.append(None if grid is None else {
            "grid": grid.to_json(),
            "exact": grid.box_at(coord, tuple(t.shape)) == (boxes[0] if boxes else None)})
    return out


def shared_parts(shared: list[str], own: list[str]) -> dict[str, Any]:
    """`Comm.allgather_shared` of this rank's entries of `shared` and `own`: what every
    rank received, and whether equal shared texts came back as one object."""
    from relight.ckpt.comm import Comm

    rank = dist.get_rank()
    comm = Comm(None, 60)
    calls = {"all_gather": 0, "broadcast": 0}

    def counted(name: str) -> Any:
        real = getattr(comm, f"_{name}")

        def call(*a: Any) -> Any:
            calls[name] += 1
            return real(*a)
        return call

    comm._all_gather = counted("all_gather")  # type: ignore[method-assign]
    comm._broadcast = counted("broadcast")  # type: ignore[method-assign]
    got = comm.allgather_shared(shared[rank].encode(), own[rank].encode())
    by_text: dict[bytes, set[int]] = {}
    for s, _ in got:
        by_text.setdefault(s, set()).add(id(s))
    return {"got": [[s.decode(), o.decode()] for s, o in got],
            "one_object_per_text": all(len(ids) == 1 for ids in by_text.values()),
            "calls": calls}


@contextlib.contextmanager
def storage_collects() -> Iterator[list[int]]:
    """Count the coordinator's collections of the ranks' indexes from storage (the
    commit's storage path) while the block runs: the list's one item."""
    import relight.ckpt.writer as writer

    collects = [0]
    real_wait = writer.wait_for_indexes

    def counted(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        collects[0] += 1
        return real_wait(*a, **kw)

    writer.wait_for_indexes = counted
    try:
        yield collects
    finally:
        writer.wait_for_indexes = real_wait


def async_commit_paths(root: str, broken_rank: int) -> dict[str, Any]:
    """Five async saves of one manager, and how each committed: saves 0-1 over the
    commit group (the first builds it), save 2 through storage (`commit_over_group`
    off), save 3 with the group failing on `broken_rank` only (it falls back to storage,
    and its abort must fail its peers' collectives so they fall back too), save 4 over a
    new group. Per save: the coordinator's storage collections, the group's id and the
    cached plan's id (one plan serves all five: the layout never changes)."""
    from relight.ckpt.commit_group import CommitGroup
    from relight.ckpt.errors import CollectiveError

    rank = dist.get_rank()
    real_comm = CommitGroup.comm
    tensors = [{"name": "w", "shape": [64, 48], "dtype": "float32"}]
    mgr = ckpt.CheckpointManager(root, keep_last=5)
    out: dict[str, Any] = {"collects": [], "groups": [], "errors": [], "plans": []}

    def fail(self):  # noqa: ANN001, ANN202
        self.mark_broken(CollectiveError("injected: this rank's group failed"))
        return real_comm(self)

    with storage_collects() as collects:
        try:
            for step in range(5):
                mgr.options = ckpt.SaveOptions(commit_timeout_s=120.0,
                                               commit_over_group=step != 2)
                if step == 3 and rank == broken_rank:
                    CommitGroup.comm = fail
                before = collects[0]
                try:
                    mgr.save(step, build(tensors, [4], [["S0"]], step),
                             async_save=True).wait()
                except Exception as e:  # noqa: BLE001 - reported to the test
                    out["errors"].append(f"{step}: {type(e).__name__}: {e}")
                CommitGroup.comm = real_comm
                group = mgr.checkpointer.commit_group
                out["collects"].append(collects[0] - before)
                out["groups"].append(None if group is None or step == 2 else group.ident)
                out["plans"].append(mgr.checkpointer.cached.ident)
        finally:
            CommitGroup.comm = real_comm
    sd = {"w": torch.zeros(64, 48)}
    out["latest"] = mgr.restore(sd)
    out["equal"] = bool(torch.equal(sd["w"], global_tensor(tensors[0], 4)))
    return out


def async_save_outlives_destroy(root: str, reinit: str) -> dict[str, Any]:
    """A script's habit: `destroy_process_group()` right after its last async save, then
    `wait()`. The commit group is not the script's to destroy: the save must commit.
    The case then joins a new default group (`reinit`), so the pool serves on."""
    from datetime import timedelta

    rank, world = dist.get_rank(), dist.get_world_size()
    mgr = ckpt.CheckpointManager(root, keep_last=3)
    mgr.save(0, {"w": torch.full((64, 48), 0.0)}, async_save=True).wait()  # builds the group
    error = None
    with storage_collects() as collects:
        try:
            h = mgr.save(1, {"w": torch.full((64, 48), 1.0)}, async_save=True)
            dist.destroy_process_group()
            h.wait()
        except Exception as e:  # noqa: BLE001 - reported to the test
            error = f"{type(e).__name__}: {e}"
    dist.init_process_group("gloo", init_method=reinit, rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    sd = {"w": torch.zeros(64, 48)}
    step = ckpt.CheckpointManager(root, keep_last=3).restore(sd)
    return {"error": error, "restored": step, "value": float(sd["w"][0, 0]),
            "storage_collects": collects[0]}
