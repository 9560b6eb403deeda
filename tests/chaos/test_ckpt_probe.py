"""The harness's view of a checkpoint root: committed steps and whole-tensor reads."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from relight import ckpt
from relight.chaos.ckpt_probe import CheckpointProbe, read_writer_commits, writer_commits
from relight.storage import open_store


def test_probe_reads_committed_state_whole(tmp_path) -> None:
    root = tmp_path / "root"
    mgr = ckpt.CheckpointManager(str(root), keep_last=None)
    weights = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    mgr.save(5, {"model": {"w": weights, "b": torch.ones(2)}, "train": {"step": 5}},
             async_save=False)
    probe = CheckpointProbe(open_store(root))
    assert probe.scan()[5].committed
    state = probe.read_state(5)
    tensors = {k: v for k, v in state.items() if not k.startswith("value:")}
    assert set(tensors) == {"model/w", "model/b"}
    assert torch.equal(tensors["model/w"], weights)
    assert torch.equal(tensors["model/b"], torch.ones(2))
    assert any(v == {"step": 5} or v == 5 for k, v in state.items() if k.startswith("value:"))


def test_reference_copied_out_of_its_store_reads_the_same(tmp_path) -> None:
    # --reference-cache keeps the reference checkpoints in a local dir whatever store the
    # reference run wrote them to (the S3 server dies with the run).
    from relight.chaos.reference import copy_store

    src_url = "memory://chaos-ref-copy"
    mgr = ckpt.CheckpointManager(src_url, keep_last=None)
    weights = torch.arange(6, dtype=torch.float32)
    mgr.save(3, {"model": {"w": weights}, "train": {"step": 3}}, async_save=False)
    copied = copy_store(open_store(src_url), open_store(tmp_path / "cache"))
    assert copied == len(open_store(src_url).list()) > 0
    probe = CheckpointProbe(open_store(tmp_path / "cache"))
    assert probe.committed_steps() == [3]
    assert torch.equal(probe.read_state(3)["model/w"], weights)
    assert probe.verify_all() == {3: None}


def test_refused_resave_of_a_committed_step_is_not_a_new_commit(tmp_path) -> None:
    # After a fallback past a damaged checkpoint the job reaches its step again; the save is
    # refused (a committed checkpoint is never overwritten) but leaves objects of a new
    # attempt. The harness must not take that for a fresh commit (chaos seed 8 did, and then
    # expected the damaged checkpoint to verify).
    root = tmp_path / "root"
    mgr = ckpt.CheckpointManager(str(root), keep_last=None)
    state = {"model": {"w": torch.ones(4)}, "train": {"step": 7}}
    mgr.save(7, state, async_save=False)
    probe = CheckpointProbe(open_store(root))
    first = probe.commits()
    assert [s for s, _ in first] == [7] and None not in {a for _, a in first}
    with pytest.raises(ckpt.CheckpointExistsError):  # async: refused in the background
        mgr.save(7, state, async_save=True)
        mgr.wait()
    store = open_store(root)
    stray = [k for k in store.list() if "/index/" in k or "/data/" in k]
    assert len({k.split("/")[2] for k in stray}) == 2  # the refused attempt left its error
    assert probe.commits() == first


RUNTIME_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
"""How `runtime.train` formats its log (`examples/user_train.py` leaves out the name)."""


class _NodeLog(logging.Handler):
    """A node's log as the harness reads it, noting whether the step's COMMIT marker
    existed when each line was written."""

    def __init__(self, fmt: str, store) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter(fmt))
        self.store = store
        self.lines: list[str] = []
        self.created: list[float] = []
        self.marker_there: list[bool] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))
        self.created.append(record.created)
        self.marker_there.append(self.store.exists("step-000000000005/COMMIT"))


@pytest.mark.parametrize("fmt", [RUNTIME_LOG_FORMAT, "%(asctime)s %(levelname)s %(message)s"])
def test_writers_commit_line_dates_the_commit_no_earlier_than_it(tmp_path, fmt) -> None:
    """The writer's `committed` line, as a node's log holds it, is the harness's record of
    when a commit happened: it follows the marker, and its time (printed in whole
    milliseconds) is read back no earlier than the line was written."""
    root = tmp_path / "root"
    store = open_store(root)
    log = _NodeLog(fmt, store)
    writer = logging.getLogger("relight.ckpt.writer")
    writer.addHandler(log)
    old_level = writer.level
    writer.setLevel(logging.INFO)
    try:
        mgr = ckpt.CheckpointManager(str(root), keep_last=None)
        mgr.save(5, {"model": {"w": torch.ones(4)}, "train": {"step": 5}}, async_save=False)
    finally:
        writer.removeHandler(log)
        writer.setLevel(old_level)
    got = writer_commits(log.lines, store.url)
    assert [c.step for c in got] == [5]
    line = next(i for i, text in enumerate(log.lines) if " committed " in text)
    assert log.marker_there[line]
    assert log.created[line] <= got[0].time <= log.created[line] + 0.0011


def test_writer_commits_of_other_roots_and_other_lines_are_ignored(tmp_path) -> None:
    root = "file:///tmp/run/ckpt-chaos"
    lines = [
        "2026-12-06 00:08:13,599 INFO relight.ckpt.writer: [rank 0 step 9] committed "
        f"{root}/step-000000000009 (156 tensors, 0.056 s)",
        "2026-12-06 00:08:13,700 INFO relight.ckpt.writer: [rank 0 step 9] committed "
        "file:///tmp/run/ckpt-reference/step-000000000009 (156 tensors, 0.056 s)",
        "2026-12-06 00:08:11,523 INFO __main__: [rank 1 step 0] no committed checkpoint "
        f"under {root}; starting from scratch",
        "2026-12-06 00:08:15,097 INFO __main__: [rank 0 step 13] checkpoint step 10 "
        "committed: 2.0 MiB from this rank, 0.33 s from start to commit",
    ]
    got = writer_commits(lines, root + "/")
    wall = time.mktime(time.strptime("2026-12-06 00:08:13", "%Y-%m-%d %H:%M:%S"))
    assert [(c.step, round(c.time - wall, 6)) for c in got] == [(9, 0.6)]
    log = tmp_path / "node-0.log"
    log.write_text("\n".join(lines) + "\n")
    assert read_writer_commits([log, tmp_path / "node-1.log"], root) == got
