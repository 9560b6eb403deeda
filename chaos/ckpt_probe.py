"""What the harness observes of checkpoints from outside: which steps are committed, which
save is in flight, a chunk of the newest committed checkpoint to damage, whether each
checkpoint verifies, and the final state of a run as plain tensors for comparison.

All of it goes through `storage` and the public `ckpt` API (`ckpt.verify`, `ckpt.load`,
the manifest reader); the names under a manager root (one prefix per step and the step
records: `ckpt.root_layout`; in a step, `COMMIT` written last and
`index/<attempt>/r<rank>.json` per rank: `ckpt.format`) are the checkpoint layer's, read
here and nowhere else in `chaos/`. So is the line a writer logs once it has committed a
step (`writer_commits`): the writer's own record of when the commit happened.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# Imported here, not on first use: the first import costs seconds on a loaded machine, and
# paid in the middle of a fault injection it would delay the fault by as much.
from relight import ckpt
from relight.chaos.verifier import WeightsComparison, WriterCommit
from relight.ckpt.export import iter_tensors
from relight.ckpt.format import COMMIT_KEY, DATA_PREFIX, INDEX_PREFIX, MANIFEST_KEY
from relight.ckpt.manifest import read_commit, read_manifest
from relight.ckpt.root_layout import RECORDS, parse_record_key, step_of_dir
from relight.storage import StorageError, Store

logger = logging.getLogger(__name__)

__all__ = ["CheckpointProbe", "StepDir", "compare_final_states", "read_writer_commits",
           "writer_commits"]

PENDING_MAX_AGE_S = 60.0

_WRITER_COMMIT = re.compile(
    r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) .* committed (\S+) \(\d+ tensors, ")
"""The line `ckpt.writer` logs once its COMMIT marker exists (`<prefix> committed <url>
(<n> tensors, <s> s)`), dated by `logging`'s default `%(asctime)s`, which the runtime's
log format and the example script's both begin with."""


@dataclass(frozen=True, slots=True)
class StepDir:
    step: int
    prefix: str
    committed: bool
    indexes: int
    """Per-rank index objects present (of the newest attempt)."""
    manifest: bool
    attempt: str | None = None
    """The newest save attempt seen for this step (a re-save of a step is a new attempt)."""


class CheckpointProbe:
    """Reads a checkpoint manager's root without ever writing to it (except `damage`)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        # Attempt ids of each step in the order first seen: the newest is the save in flight
        # (a killed save leaves its attempt behind, and storage keeps no mtimes).
        self._attempts: dict[int, list[str]] = {}
        self._commit_attempts: dict[str, str | None] = {}

    def scan(self) -> dict[int, StepDir]:
        """Every step prefix under the root: committed or not, indexes written so far
        (nothing when the root cannot be listed)."""
        try:
            return self._scan()
        except StorageError as exc:
            logger.debug("cannot list %s: %s", self.store.url, exc)
            return {}

    def _scan(self) -> dict[int, StepDir]:
        keys = self.store.list()
        per: dict[str, dict[str, Any]] = {}
        for key in keys:
            if "/" not in key:
                continue
            prefix, rest = key.split("/", 1)
            step = step_of_dir(prefix)
            if step is None:
                continue
            d = per.setdefault(prefix, {"step": step, "commit": False,
                                        "manifest": False, "idx": {}})
            if rest == COMMIT_KEY:
                d["commit"] = True
            elif rest == MANIFEST_KEY:
                d["manifest"] = True
            elif rest.startswith((INDEX_PREFIX, DATA_PREFIX)):
                attempt = rest.split("/")[1]
                n = 1 if rest.startswith(INDEX_PREFIX) and rest.endswith(".json") and (
                    ".error" not in rest) else 0
                d["idx"][attempt] = d["idx"].get(attempt, 0) + n
        out: dict[int, StepDir] = {}
        for prefix, d in per.items():
            order = self._attempts.setdefault(d["step"], [])
            order += sorted(a for a in d["idx"] if a not in order)
            current = next((a for a in reversed(order) if a in d["idx"]), None)
            out[d["step"]] = StepDir(d["step"], prefix, d["commit"],
                                     d["idx"].get(current, 0) if current else 0, d["manifest"],
                                     current)
        return out

    def commits(self) -> set[tuple[int, str | None]]:
        """(step, attempt) of every committed checkpoint, the attempt named by its COMMIT
        marker: a step saved again after a fallback (its old checkpoint collected) shows
        up as a new pair, so its new commit is seen as one; a re-save refused because the
        step is still committed leaves objects of a new attempt but is not a commit.

        Raises `StorageError` when the root cannot be listed: an empty answer would
        claim that no step is committed at the time of the listing."""
        out = set()
        for d in self._scan().values():
            if d.committed:
                out.add((d.step, self._committed_attempt(d.prefix)))
            else:
                self._commit_attempts.pop(d.prefix, None)  # collected: a new COMMIT may come
        return out

    def _committed_attempt(self, prefix: str) -> str | None:
        """The attempt in `prefix`'s COMMIT marker, read once per marker (a marker is only
        ever created, never rewritten, while it exists)."""
        if prefix not in self._commit_attempts:
            try:
                attempt = read_commit(self.store.child(prefix)).get("attempt")
            except (StorageError, ckpt.CheckpointError) as exc:
                logger.debug("cannot read %s/%s: %s", prefix, COMMIT_KEY, exc)
                return None  # not cached: read again at the next poll
            self._commit_attempts[prefix] = None if attempt is None else str(attempt)
        return self._commit_attempts[prefix]

    def _fresh_pending(self, max_age_s: float) -> set[int]:
        """Steps whose save started less than `max_age_s` ago and has not committed (the
        manager's `steps/<step>.pending` record holds the start time)."""
        out = set()
        try:
            keys = self.store.list(RECORDS)
        except StorageError:
            return out
        now = time.time()
        for key in keys:
            parsed = parse_record_key(key)
            if parsed is None or parsed[1] != "pending":
                continue
            try:
                started = float(self.store.get(key).decode() or 0.0)
            except (StorageError, ValueError):
                continue
            if now - started < max_age_s:
                out.add(parsed[0])
        return out

    def committed_steps(self) -> list[int]:
        return sorted(s for s, d in self.scan().items() if d.committed)

    def phase(self, world_size: int) -> dict[str, Any]:
        """The save in flight, if any: `persist` (data/indexes being written) or
        `before_commit` (every rank's index is written, the commit marker is not)."""
        dirs = self.scan()
        fresh = self._fresh_pending(PENDING_MAX_AGE_S)
        pending = [d for d in dirs.values() if not d.committed and d.step in fresh]
        if not pending:
            return {"phase": "training"}
        d = max(pending, key=lambda d: d.step)
        phase = "before_commit" if d.indexes >= world_size else "persist"
        return {"phase": phase, "checkpoint_step": d.step, "indexes": d.indexes}

    def newest_committed_chunk(self) -> tuple[int, str]:
        """(step, key) of one data chunk of a real tensor in the newest committed checkpoint."""
        dirs = self.scan()
        steps = sorted(s for s, d in dirs.items() if d.committed)
        if not steps:
            raise LookupError(f"no committed checkpoint under {self.store.url} yet")
        # Retention may delete the newest-but-one between the listing and the read (it
        # removes COMMIT first): take the newest whose manifest still reads.
        for step in reversed(steps):
            prefix = dirs[step].prefix
            try:
                manifest = read_manifest(self.store.child(prefix))
                break
            except (ckpt.CheckpointError, StorageError) as exc:
                logger.info("checkpoint %d under %s went away while picking one: %s", step,
                            self.store.url, exc)
        else:
            raise LookupError(f"no committed checkpoint under {self.store.url} could be read")
        objects = manifest.expected_objects()
        chunks = sorted(k for k in objects if not k.endswith("zarr.json"))
        if not chunks:
            raise LookupError(f"checkpoint {step} under {self.store.url} has no data chunk")
        # Prefer the largest tensor's own chunk; small tensors live packed per writer rank
        # (tensor name ''), and any packed chunk holds parameters too.
        tensors = manifest.tensors
        chunks.sort(key=lambda k: (-_numel(tensors[objects[k]].get("shape", []))
                                   if objects[k] else 0, k))
        return step, f"{prefix}/{chunks[0]}"

    def verify_all(self) -> dict[int, str | None]:
        """Every committed checkpoint: step -> None when it verifies, else the problems."""
        out: dict[int, str | None] = {}
        for step, d in sorted(self.scan().items()):
            if not d.committed:
                continue
            rep = ckpt.verify(self.store.child(d.prefix))
            out[step] = None if rep.ok else "; ".join(rep.problems)[:500]
        return out

    def read_state(self, step: int) -> dict[str, Any]:
        """The committed checkpoint `step` as {name: full tensor or JSON value}."""
        d = self.scan().get(step)
        if d is None or not d.committed:
            raise LookupError(f"no committed checkpoint {step} under {self.store.url}")
        store = self.store.child(d.prefix)
        manifest = read_manifest(store)
        out: dict[str, Any] = dict(iter_tensors(store, manifest, sorted(manifest.tensors)))
        for name, value in manifest.values.items():
            out[f"value:{name}"] = value
        return out


def writer_commits(lines: Iterable[str], root_url: str) -> list[WriterCommit]:
    """The commits of checkpoints under `root_url` that the writers logged in `lines` (a
    node's log, where its workers' output goes). A line prints local time (every node
    runs on this machine, with its clock and zone) in milliseconds rounded down: a
    millisecond is added, so that no record is dated before the commit it follows."""
    root = root_url.rstrip("/")
    out = []
    for line in lines:
        m = _WRITER_COMMIT.search(line)
        if m is None:
            continue
        parent, _, name = m.group(3).rpartition("/")
        step = step_of_dir(name)
        if step is None or parent != root:
            continue  # a checkpoint of another root
        wall = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S"))
        out.append(WriterCommit(step, wall + (int(m.group(2)) + 1) / 1000))
    return out


def read_writer_commits(paths: Iterable[Path], root_url: str) -> list[WriterCommit]:
    """`writer_commits` of every log in `paths` (a log never written is skipped)."""
    out: list[WriterCommit] = []
    for path in paths:
        try:
            with open(path, errors="replace") as fh:
                out += writer_commits(fh, root_url)
        except FileNotFoundError:
            continue
    return out


_LAYOUT_KEYS = ("layout", "config")


def _without_layout(value: Any) -> Any:
    """A run's record of its own layout and config legitimately differs between runs."""
    if isinstance(value, dict):
        return {k: v for k, v in value.items() if k not in _LAYOUT_KEYS} or None
    return value


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def compare_final_states(chaos: dict[str, Any], ref: dict[str, Any], *, rtol: float,
                         atol: float, chaos_step: int, ref_step: int) -> WeightsComparison:
    """Tensor-by-tensor comparison; JSON values must be equal except the run's own record
    of its layout and config (which legitimately differ after a layout change)."""
    cmp = WeightsComparison(compared=True, chaos_step=chaos_step, reference_step=ref_step,
                            bitwise_equal=True)
    for key in sorted(set(chaos) | set(ref)):
        if key not in chaos or key not in ref:
            cmp.mismatched.append(f"{key} (only in {'chaos' if key in chaos else 'reference'})")
            cmp.bitwise_equal = False
            continue
        a, b = chaos[key], ref[key]
        if key.startswith("value:"):
            a, b = _without_layout(a), _without_layout(b)
            if a is None and b is None:
                continue
            if a != b:
                cmp.mismatched.append(f"{key}: {a!r} != {b!r}")
                cmp.bitwise_equal = False
            continue
        cmp.tensors += 1
        if a.shape != b.shape or a.dtype != b.dtype:
            cmp.mismatched.append(f"{key}: shape/dtype {tuple(a.shape)}/{a.dtype} vs "
                                  f"{tuple(b.shape)}/{b.dtype}")
            cmp.bitwise_equal = False
            continue
        if torch.equal(a, b):
            continue
        cmp.bitwise_equal = False
        cmp.not_bitwise.append(key)
        if a.is_floating_point():
            diff = (a.double() - b.double()).abs()
            cmp.max_abs_diff = max(cmp.max_abs_diff, float(diff.max()))
            rel = diff / b.double().abs().clamp_min(1e-12)
            cmp.max_rel_diff = max(cmp.max_rel_diff, float(rel.max()))
            if not torch.allclose(a.double(), b.double(), rtol=rtol, atol=atol):
                cmp.mismatched.append(f"{key}: max abs diff {float(diff.max()):.3g} outside "
                                      f"rtol={rtol:g}, atol={atol:g}")
        else:
            cmp.mismatched.append(f"{key}: integer tensor differs")
    return cmp
