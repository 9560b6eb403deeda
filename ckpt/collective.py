"""One exception-robust collective: catch locally, all-gather, raise on every rank.

A rank that fails before a collective must still make it, or the others wait for it
until their timeout. So each step that may fail on some ranks only runs as

    error = None
    try:
        payload = local_work()
    except Exception as e:
        error = e
    payloads = all_or_raise(comm, error, payload, what, url=url)

`all_or_raise` all-gathers (error, payload) from every rank; the failing rank raises its
own exception, every other rank raises one built from the first failure (by default
the same type when it is a `ckpt.errors.CheckpointError` or a `storage.StorageError`,
so that a retryable storage failure stays retryable on every rank), and when no rank
failed every rank gets every rank's payload. Errors cross ranks as JSON (type name and
message), never pickled.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import relight.ckpt.errors as ckpt_errors
import relight.storage.errors as storage_errors
from relight.ckpt.comm import Comm, parse_json_list
from relight.ckpt.errors import CheckpointError, CorruptCheckpointError
from relight.storage import StorageError

__all__ = ["RemoteError", "all_or_raise", "coordinator_outcome", "encode_error",
           "gather_or_raise", "raise_gathered", "raise_if_any", "rebuild_error"]

RemoteError = dict[str, str]
"""A failure as it crosses ranks: {"type": class name, "msg": str(exception)}."""


def encode_error(e: BaseException) -> RemoteError:
    return {"type": type(e).__name__, "msg": str(e)}


def rebuild_error(e: RemoteError, rank: int, url: str | None) -> BaseException:
    """Another rank's error as the same type: a storage failure stays a `StorageError`
    (retryable), damage a `CheckpointError`; anything else becomes a
    `CorruptCheckpointError` naming the original type."""
    msg = f"rank {rank}: {e['msg']}"
    cls = getattr(ckpt_errors, e["type"], None)
    if isinstance(cls, type) and issubclass(cls, CheckpointError):
        return cls(msg, url=url)
    cls = getattr(storage_errors, e["type"], None)
    if isinstance(cls, type) and issubclass(cls, StorageError):
        return cls(msg, url=url)
    return CorruptCheckpointError(f"rank {rank}: {e['type']}: {e['msg']}", url=url)


def _first_rebuilt(url: str | None) -> Callable[[Mapping[int, RemoteError]], BaseException]:
    def build(failures: Mapping[int, RemoteError]) -> BaseException:
        rank = next(iter(failures))
        return rebuild_error(failures[rank], rank, url)
    return build


def all_or_raise(comm: Comm, error: BaseException | None, payload: Any = None,
                 what: str = "a checkpoint collective", *, url: str | None = None,
                 remote: Callable[[Mapping[int, RemoteError]], BaseException] | None = None,
                 ) -> list[Any]:
    """All-gather `payload` (JSON) and `error` from every rank of `comm`; every rank
    calls, whether its own step failed or not.

    Raises `error` on the rank that has one; on the others, when any rank failed,
    `remote(failures)` (failures: global rank -> `RemoteError`, in group order; default:
    the first failure rebuilt as its own type by `rebuild_error`). Otherwise returns the
    payloads in group order. `what` names the step in a `CollectiveError` on timeout.
    """
    gathered = comm.allgather_json(
        {"err": encode_error(error) if error is not None else None,
         "data": payload if error is None else None}, what)
    raise_gathered(comm, error, [g["err"] for g in gathered], url=url, remote=remote)
    return [g["data"] for g in gathered]


def raise_gathered(comm: Comm, error: BaseException | None,
                   errors: list[RemoteError | None], *, url: str | None = None,
                   remote: Callable[[Mapping[int, RemoteError]], BaseException] | None = None,
                   ) -> None:
    """After a collective that carried every rank's failure (`errors`, in group order):
    raise `error` on the rank that has one; on the others, when any rank failed,
    `remote(failures)` (default: the first failure rebuilt as its own type)."""
    if error is not None:
        raise error
    failures = {r: e for r, e in zip(comm.ranks, errors, strict=True) if e}
    if failures:
        raise (remote or _first_rebuilt(url))(failures)


def raise_if_any(comm: Comm, error: BaseException | None,
                 what: str = "a checkpoint collective", *, url: str | None = None,
                 remote: Callable[[Mapping[int, RemoteError]], BaseException] | None = None,
                 all_gather: bool = False) -> None:
    """`all_or_raise` without payloads, for a step that seldom fails: every rank's 1-byte
    flag goes to the coordinator, which says whether any rank failed (a gather and a
    broadcast), or with `all_gather` to every rank (one collective, n bytes received per
    rank); only then do the errors' texts cross (`all_or_raise`)."""
    flag = b"E" if error is not None else b"-"
    if all_gather:
        failed = _any_failed(comm.allgather_fixed(flag, 1, what)) == b"E"
    else:
        failed = comm.ask_coordinator(flag, 1, _any_failed, 1, what) == b"E"
    if failed:
        all_or_raise(comm, error, None, what, url=url, remote=remote)


def _any_failed(flags: list[bytes]) -> bytes:
    return b"E" if any(f[:1] == b"E" for f in flags) else b"-"


def coordinator_outcome(comm: Comm, error: BaseException | None,
                        what: str = "a checkpoint collective", *, url: str | None = None,
                        remote: Callable[[Mapping[int, RemoteError]], BaseException] | None
                        = None) -> None:
    """For a step only the coordinator runs (a commit): it broadcasts whether its step
    failed, and only then do the errors' texts cross (`all_or_raise`): every rank
    raises."""
    flag = comm.broadcast_fixed(b"E" if comm.is_coordinator and error is not None
                                else b"-", 1, what)
    if flag == b"E":
        all_or_raise(comm, error, None, what, url=url, remote=remote)


def gather_or_raise(comm: Comm, error: BaseException | None, payload: Any = None,
                    what: str = "a checkpoint collective", *, url: str | None = None,
                    remote: Callable[[Mapping[int, RemoteError]], BaseException] | None = None,
                    ) -> list[Any] | None:
    """`all_or_raise` for a payload only the coordinator needs: a gather of each rank's
    failure flag and payload size to the coordinator, which broadcasts whether any rank
    failed and the longest size (the errors' texts follow, through `all_or_raise`, only
    when some rank failed); then one gather brings the payloads to the coordinator.
    Returns them in group order on the coordinator, None on the others. No ring
    all-gather on the way: at thousands of ranks each is thousands of hops.

    The payloads of a save's commit are each rank's index (its chunk crc32c): all-gathered,
    every rank received, and parsed, every other rank's, a volume that grows with the
    square of the world size and that only the coordinator uses."""
    blob = b""
    if error is None:
        try:
            blob = json.dumps(payload, separators=(",", ":")).encode()
        except (TypeError, ValueError) as e:
            error = e
    lens: list[int] = []

    def decide(heads: list[bytes]) -> bytes:  # the coordinator: any failure, longest payload
        lens.extend(int.from_bytes(h[1:9], "little") for h in heads)
        return _any_failed(heads) + max(lens).to_bytes(8, "little")

    verdict = comm.ask_coordinator(
        (b"E" if error is not None else b"-") + len(blob).to_bytes(8, "little"), 9, decide,
        9, what)
    if verdict[:1] == b"E":  # the errors' texts cross, and every rank raises
        all_or_raise(comm, error, None, what, url=url, remote=remote)
    blobs = comm.gather_bytes(blob, lens or [int.from_bytes(verdict[1:9], "little")], what)
    return None if blobs is None else parse_json_list(blobs)
