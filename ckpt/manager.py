"""`CheckpointManager`: when to save, what to keep, what to restore.

The layout under the root URL (step prefixes, the manager's step records, what counts as
committed) is `ckpt.root_layout`'s.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from relight.ckpt.checkpointer import Checkpointer
from relight.ckpt.collective import RemoteError, all_or_raise
from relight.ckpt.comm import Comm
from relight.ckpt.commit import CommitHooks
from relight.ckpt.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    NoLoadableCheckpointError,
    SavesFailingError,
    UnsupportedVersionError,
)
from relight.ckpt.handle import SaveHandle
from relight.ckpt.loader import LoadInfo
from relight.ckpt.manifest import Manifest
from relight.ckpt.options import SaveOptions
from relight.ckpt.root_layout import (
    commit_key,
    committed_steps,
    list_records,
    newest_committed_step,
    pending_key,
    record_key,
    step_dir,
)
from relight.rank_log import rank_step_prefix
from relight.storage import StorageError, Store, open_store

logger = logging.getLogger(__name__)

__all__ = ["CheckpointManager", "RetentionPolicy", "KeepLast", "KeepEvery", "SaveFailurePolicy"]

BUSY_POLICIES = ("wait", "skip")


def _check_busy(busy: str) -> None:
    if busy not in BUSY_POLICIES:
        raise ValueError(f"CheckpointManager busy must be one of {BUSY_POLICIES}, got {busy!r}")


class RetentionPolicy(Protocol):
    def keep(self, committed: list[int]) -> set[int]:
        """Of the committed steps (ascending), those this policy keeps."""
        ...


@dataclass(frozen=True, slots=True)
class KeepLast:
    """Keep the newest `n` committed checkpoints."""

    n: int

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"KeepLast needs n >= 1, got {self.n}")

    def keep(self, committed: list[int]) -> set[int]:
        return set(committed[-self.n:])


@dataclass(frozen=True, slots=True)
class KeepEvery:
    """Keep every checkpoint whose step is a multiple of `every` (permanent snapshots)."""

    every: int

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"KeepEvery needs every >= 1, got {self.every}")

    def keep(self, committed: list[int]) -> set[int]:
        return {s for s in committed if s % self.every == 0}


@dataclass(frozen=True, slots=True)
class SaveFailurePolicy:
    """When failed asynchronous saves stop the run. An async save's failure surfaces at
    the next `save()` (or `wait()`), is logged as an error and counted; a run whose saves
    keep failing (a wrong bucket, storage down for hours) must not train on without
    checkpoints unnoticed."""

    max_consecutive: int | None = 3
    """Raise `SavesFailingError` from `save()`/`wait()` once this many saves in a row
    have failed; None: never (log and count only)."""

    def __post_init__(self) -> None:
        if self.max_consecutive is not None and self.max_consecutive < 1:
            raise ValueError(f"SaveFailurePolicy.max_consecutive must be >= 1 or None, got "
                             f"{self.max_consecutive}")


def collect_garbage(store: Store, policies: list[RetentionPolicy], grace_s: float,
                    protect: set[int] | None = None) -> list[int]:
    """Delete committed steps no policy keeps (never the newest) and stale pending ones
    (older than `grace_s`). Returns the steps deleted."""
    records = list_records(store)
    committed = sorted(s for s, r in records.items() if r.committed)
    keep = set(protect or ())
    if committed:
        keep.add(committed[-1])
    for p in policies:
        keep |= p.keep(committed)
    now = time.time()
    deleted = []
    for step, rec in sorted(records.items()):
        if step in keep:
            continue
        if rec.committed:
            # COMMIT first: from here on nothing loads it, even if we die half-way.
            store.delete(commit_key(step))
        elif now - rec.created < grace_s:
            continue
        store.delete(record_key(step))
        store.delete_prefix(step_dir(step))
        store.delete(pending_key(step))
        deleted.append(step)
        logger.info("gc %s: deleted step %d (%s)", store.url, step,
                    "retention" if rec.committed else "stale, never committed")
    return deleted


@dataclass(frozen=True, slots=True)
class _StepRecords:
    """The manager's part of one save's commit protocol (`ckpt.commit.CommitHooks`):
    the step's records under `steps/` and the GC after its commit."""

    mgr: CheckpointManager
    step: int

    def hooks(self) -> CommitHooks:
        return CommitHooks(on_start=self.pending, before_commit=self.record,
                           on_commit=self.committed)

    def pending(self) -> None:
        self.mgr.store.put(pending_key(self.step), str(time.time()).encode())

    def record(self, manifest: Manifest) -> None:
        # Written just before COMMIT, so every rank that sees COMMIT also finds the
        # record; a record whose COMMIT never came is treated as uncommitted.
        self.mgr.store.put(record_key(self.step), json.dumps({
            "step": self.step, "created_unix": manifest.created_unix,
            "bytes": manifest.bytes, "world_size": manifest.world_size,
            "layout": manifest.layout}).encode())

    def committed(self, manifest: Manifest) -> None:
        mgr = self.mgr
        mgr.store.delete(pending_key(self.step))
        try:
            collect_garbage(mgr.store, mgr.policies, mgr.gc_grace_s, protect={self.step})
        except Exception as e:  # noqa: BLE001 - GC must never fail a committed save
            logger.warning("gc of %s after step %d failed: %s", mgr.store.url, self.step, e)


class CheckpointManager:
    """Saves, retention and restore for one run's checkpoints under `root_url`.

    Every rank calls `save`, `restore` (collective); `latest_step` and `wait` are local.
    The coordinator writes the step records and runs GC after each commit, in the
    background save thread, through storage only.

    Args:
        root_url: the run's checkpoint root (a `storage` URL or `Store`); each step is
            saved under `step-<step>/`.
        keep_last: keep the newest this many committed steps (None: no such policy).
        keep_every: also keep every step that is a multiple of this (None: none).
        process_group: the group saving and restoring together (default: the world).
        options: `SaveOptions` of every save.
        config: JSON recorded in every manifest (unless `save` gets its own).
        layout: JSON recorded in every manifest: how the run is parallelized.
        gc_grace_s: an uncommitted step older than this is garbage.
        policies: more `RetentionPolicy`s; a step any policy keeps is kept.
        busy: "wait" or "skip": what `save` does while the previous save persists.
        on_failures: when failed saves stop the run (`SaveFailurePolicy`).
        checkpointer: the engine to save and load with (default: a new one, the
            manager's own).

    Raises:
        ValueError: `busy`, `keep_last` or `keep_every` is invalid.
        InvalidStorageURLError: `root_url` is not a storage URL.
    """

    def __init__(
        self,
        root_url: str | os.PathLike[str] | Store,
        keep_last: int | None = 3,
        keep_every: int | None = None,
        *,
        process_group: Any = None,
        options: SaveOptions | None = None,
        config: dict[str, Any] | None = None,
        layout: dict[str, Any] | None = None,
        gc_grace_s: float = 3600.0,
        policies: list[RetentionPolicy] | None = None,
        busy: str = "wait",
        on_failures: SaveFailurePolicy | None = None,
        checkpointer: Checkpointer | None = None,
    ) -> None:
        _check_busy(busy)
        self.checkpointer = checkpointer or Checkpointer()
        """The engine this manager saves and loads with: its own unless one is given
        (its cached plan, staging buffers, save worker and the pages of its last save)."""
        self.store = open_store(root_url)
        self.process_group = process_group
        self.options = options or SaveOptions()
        self.config = config
        self.layout = layout
        self.gc_grace_s = gc_grace_s
        self.policies: list[RetentionPolicy] = list(policies or [])
        if keep_last is not None:
            self.policies.append(KeepLast(keep_last))
        if keep_every is not None:
            self.policies.append(KeepEvery(keep_every))
        self.busy = busy
        """What `save` does while the previous save is still persisting: "wait" for it
        (training stalls, every checkpoint is taken) or "skip" this one (training goes
        on; the next save point tries again). Either way at most one save is in flight
        and its staging buffers are reused, so memory stays bounded."""
        self.on_failures = on_failures or SaveFailurePolicy()
        """When failed saves stop the run (default: 3 in a row)."""
        self._handle: SaveHandle | None = None
        self._accounted: SaveHandle | None = None
        self.consecutive_failed_saves = 0
        """Failed saves since the last one that committed."""
        self.failed_saves = 0
        self.waited_saves = 0
        """Saves that had to wait for the previous one to finish persisting."""
        self.skipped_saves = 0
        """Saves dropped by busy="skip" because the previous one was still persisting."""
        self.last_error: BaseException | None = None
        self.last_wait_s = 0.0
        self.last_load: LoadInfo | None = None
        """What the last successful `restore()` loaded (`missing`, `unexpected` with
        strict=False)."""

    # -- saving -------------------------------------------------------------------------

    def save(self, step: int, state_dict: dict[str, Any], async_save: bool = True, *,
             config: dict[str, Any] | None = None,
             layout: dict[str, Any] | None = None,
             busy: str | None = None) -> SaveHandle | None:
        """Checkpoint `state_dict` as `step`. A failure of the previous save is logged and
        counted here (training goes on) and raised by `wait()`.

        While the previous save is still persisting, `busy` (default: the manager's) says
        whether to wait for it or skip this step: skipped, it returns None, and the
        caller's state was not touched. Pass busy="wait" for a save that must happen (the
        last step, a preemption). With "skip" the ranks agree (one small all-gather): a
        step is skipped on every rank if any rank's previous save is still running.

        Args:
            step: the step; the checkpoint goes to `url_of(step)`.
            state_dict: what to save (as for `ckpt.save`).
            async_save: persist and commit in the background (default).
            config: JSON for this step's manifest instead of the manager's.
            layout: JSON for this step's manifest instead of the manager's.
            busy: "wait" or "skip" for this save instead of the manager's.

        Returns:
            The save's `SaveHandle`, or None when the step was skipped.

        Raises:
            SavesFailingError: the previous save failed and makes
                `on_failures.max_consecutive` failures in a row.
            ValueError: `busy` is neither "wait" nor "skip".
            Any error of `ckpt.save` (a synchronous save's failure, a collective timeout).
        """
        policy = self.busy if busy is None else busy
        _check_busy(policy)
        prev = self._handle
        running = prev is not None and not prev.done()
        if policy == "skip":
            running = any(Comm(self.process_group, self.options.collective_timeout_s
                               ).allgather_json(running, f"the busy check of checkpoint "
                                                f"step {step} under {self.store.url} (every "
                                                "rank must call CheckpointManager.save)"))
        if running:
            if policy == "skip":
                self.skipped_saves += 1
                logger.warning("checkpoint step %d skipped: step %s is still persisting to "
                               "%s (busy=skip; %d skipped so far)", step,
                               getattr(prev, "step", None), self.store.url, self.skipped_saves)
                return None
            self.waited_saves += 1
            logger.info("checkpoint step %d waits for step %s, still persisting to %s "
                        "(busy=wait)", step, getattr(prev, "step", None), self.store.url)
        if prev is not None:
            t0 = time.perf_counter()
            try:
                prev.wait()
            except Exception as e:  # noqa: BLE001 - reported, training continues
                self.failed_saves += 1
                self._failed(prev, e)
            else:
                self._account(prev, None)
            self.last_wait_s = time.perf_counter() - t0
            if self.last_wait_s > 0.001:
                logger.info("save of step %d waited %.3f s for step %s", step,
                            self.last_wait_s, prev.step)
        self._handle = self.checkpointer.save(
            state_dict, self.store.child(step_dir(step)), async_save=async_save, step=step,
            config=config if config is not None else self.config,
            layout=layout if layout is not None else self.layout,
            process_group=self.process_group, options=self.options,
            hooks=_StepRecords(self, step).hooks())
        return self._handle

    def wait(self) -> None:
        """Block until the save in flight is committed; raise its error (as
        `SavesFailingError` when it makes `on_failures.max_consecutive` in a row).

        Raises:
            CheckpointError: the save's failure (`CheckpointSaveError`,
                `CheckpointExistsError`, ...), or `SavesFailingError` as above.
        """
        if self._handle is not None:
            try:
                self._handle.wait()
            except Exception as e:
                self._failed(self._handle, e)
                raise
            self._account(self._handle, None)

    def close(self) -> None:
        """Wait for the save in flight (raising its error, as `wait()`), then let the
        engine's save threads end. A later `save()` starts them again."""
        try:
            self.wait()
        finally:
            self.checkpointer.close()

    def _account(self, handle: SaveHandle, error: BaseException | None) -> bool:
        """Count a finished save's outcome once; False if it was counted already."""
        if handle is self._accounted:
            return False
        self._accounted = handle
        if error is None:
            self.consecutive_failed_saves = 0
        else:
            self.consecutive_failed_saves += 1
            self.last_error = error
        return True

    def _failed(self, handle: SaveHandle, error: BaseException) -> None:
        """Log a failed save (every time) and raise `SavesFailingError` once the policy's
        limit of failures in a row is reached."""
        if self._account(handle, error):
            limit = self.on_failures.max_consecutive
            logger.error("checkpoint step %s failed under %s (%d in a row%s): %s",
                         handle.step, self.store.url, self.consecutive_failed_saves,
                         f"; the run stops at {limit}" if limit else "", error)
        limit = self.on_failures.max_consecutive
        if limit is not None and self.consecutive_failed_saves >= limit:
            raise SavesFailingError(
                f"the last {self.consecutive_failed_saves} checkpoint saves under "
                f"{self.store.url} failed (SaveFailurePolicy.max_consecutive={limit}); "
                f"the newest committed step is unchanged since. Last failure (step "
                f"{handle.step}): {type(error).__name__}: {error}", url=self.store.url,
                failures=getattr(error, "failures", None)) from error

    # -- finding ------------------------------------------------------------------------

    def committed_steps(self) -> list[int]:
        """Steps whose record and COMMIT marker both exist (ascending).

        Raises:
            StorageError: listing or checking the markers failed.
        """
        return committed_steps(self.store)

    def latest_step(self) -> int | None:
        """The newest committed step, or None.

        Raises:
            StorageError: listing or checking the markers failed.
        """
        return newest_committed_step(self.store)

    def url_of(self, step: int) -> str:
        """The URL of `step`'s checkpoint (committed or not)."""
        return self.store.child(step_dir(step)).url

    # -- restoring ----------------------------------------------------------------------

    def restore(self, state_dict: dict[str, Any], step: int | None = None, *,
                strict: bool = True) -> int:
        """Load `step` (default: the newest committed one that loads cleanly) into
        `state_dict`; falls back to older committed steps when a newer one is damaged,
        logging which one it used and why. Returns the step restored; `last_load` says
        what was loaded (with strict=False: what was missing or ignored).

        Args:
            state_dict: the target, filled in place (as for `ckpt.load`).
            step: this step only, no fallback (default: the newest that loads).
            strict: as for `ckpt.load`.

        Returns:
            The step restored.

        Raises:
            CheckpointNotFoundError: no committed step, or none could be loaded while
                storage failed too (a retry may succeed).
            NoLoadableCheckpointError: every committed step is damaged or unsupported.
            StorageError: listing the steps failed on the coordinator.
            MissingKeyError, UnexpectedKeyError, ShapeMismatchError, DtypeMismatchError:
                the state dict does not match (never a reason to fall back).
            With `step` given: any error of `ckpt.load` for that step.
        """
        comm = Comm(self.process_group, self.options.collective_timeout_s)
        # Every rank must try the same steps in the same order: the coordinator decides,
        # and only it lists (the others' listings would be thrown away).
        # A listing that fails is shared too, so no rank is left waiting in the gather.
        found: list[int] | None = None
        failed: Exception | None = None
        if comm.is_coordinator:
            try:
                found = [step] if step is not None else self.committed_steps()[::-1]
            except Exception as e:  # noqa: BLE001 - raised by all_or_raise, on every rank
                failed = e

        def listing_failed(failures: Mapping[int, RemoteError]) -> BaseException:
            e = failures[comm.coordinator]
            return StorageError(f"listing the checkpoints under {self.store.url} failed on "
                                f"the coordinator: {e['type']}: {e['msg']}", url=self.store.url)

        candidates = all_or_raise(comm, failed, found, f"the restore from {self.store.url} "
                                  "(every rank must call CheckpointManager.restore)",
                                  url=self.store.url, remote=listing_failed)[0]  # coordinator's
        if not candidates:
            raise CheckpointNotFoundError(
                f"no committed checkpoint under {self.store.url}; start from scratch or "
                "point at another root", url=self.store.url)
        reasons = []
        storage_failed = False
        for s in candidates:
            try:
                self.last_load = self.checkpointer.load(state_dict, self.store.child(step_dir(s)),
                                      strict=strict, process_group=self.process_group,
                                      collective_timeout_s=self.options.collective_timeout_s)
            except (CorruptCheckpointError, CheckpointNotFoundError,
                    UnsupportedVersionError, StorageError) as e:
                if step is not None:
                    raise
                storage_failed |= isinstance(e, (StorageError, CheckpointNotFoundError))
                reasons.append(f"step {s}: {e}")
                logger.warning("%s checkpoint step %d under %s is unusable (%s); "
                               "falling back to an older one", rank_step_prefix(comm.rank), s,
                               self.store.url, e)
                continue
            if reasons:
                logger.warning("%s restored step %d after skipping: %s",
                               rank_step_prefix(comm.rank), s, "; ".join(reasons))
            else:
                logger.info("%s restored step %d from %s", rank_step_prefix(comm.rank), s,
                            self.store.url)
            return s
        if storage_failed:  # storage may answer on a retry
            raise CheckpointNotFoundError(
                f"no committed checkpoint under {self.store.url} could be loaded: "
                + "; ".join(reasons), url=self.store.url)
        raise NoLoadableCheckpointError(
            f"every committed checkpoint under {self.store.url} is damaged or unsupported: "
            + "; ".join(reasons) + ". Restarting cannot fix this: check them with `relight "
            "ckpt verify`, then point checkpoint.url at another root, or move the damaged "
            "steps aside to start over", url=self.store.url)

    def gc(self) -> list[int]:
        """Apply the retention policies now (coordinator only; storage only).

        Returns:
            The steps deleted.

        Raises:
            StorageError: listing or deleting failed.
        """
        protect = {self._handle.step} if self._handle and not self._handle.done() \
            and self._handle.step is not None else set()
        return collect_garbage(self.store, self.policies, self.gc_grace_s, protect)

