"""Two writers racing on one checkpoint: exactly one commits, the other gets a typed
error, the committed checkpoint loads bitwise and an older one is untouched."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from relight import ckpt, storage
from relight.ckpt.commit import publish_commit
from relight.ckpt.format import COMMIT_KEY, MANIFEST_KEY
from relight.ckpt.root_layout import step_dir

from ._util import assert_bitwise, local_store, make_state, snapshot, tally, zeros_like


class Writer:
    """One finished but uncommitted save (its data and index objects in place)."""

    def __init__(self, target: storage.Store, scratch: storage.Store, seed: int) -> None:
        self.state = make_state(seed)
        ckpt.save(self.state, scratch, step=2)
        self.raw = scratch.get(MANIFEST_KEY)
        self.marker = json.loads(scratch.get(COMMIT_KEY))
        self.attempt = self.marker["attempt"]
        for key in scratch.list():
            if key.startswith(("data/", "index/")):
                target.put(key, scratch.get(key))

    def publish(self, store: storage.Store, before_commit=None) -> None:
        publish_commit(store, self.attempt, self.raw, self.marker, before_commit)


@pytest.fixture
def race(tmp_path):
    root = local_store(tmp_path / "run")
    mgr = ckpt.CheckpointManager(root)
    mgr.save(1, make_state(1), async_save=False)
    older = snapshot(root, step_dir(1))
    target = root.child(step_dir(2))
    a = Writer(target, local_store(tmp_path / "a"), 10)
    b = Writer(target, local_store(tmp_path / "b"), 20)
    yield root, target, a, b
    # Whatever the interleaving: step 1 is untouched and still loads bitwise.
    assert snapshot(root, step_dir(1)) == older
    got = zeros_like(make_state(1))
    ckpt.load(got, root.child(step_dir(1)))
    assert_bitwise(got, make_state(1))
    tally("bad_inputs")
    tally("checkpoints_checked", 2)


def _loads(store: storage.Store, writer: Writer) -> None:
    got = zeros_like(writer.state)
    ckpt.load(got, store)
    assert_bitwise(got, writer.state)
    assert ckpt.verify(store).ok


def _assert_lost(excinfo, store: storage.Store) -> None:
    err = excinfo.value
    assert isinstance(err, FileExistsError) and err.obj == COMMIT_KEY
    assert store.url in str(err) and "another writer committed" in str(err)


def test_second_writer_after_commit_is_refused(race) -> None:
    _, target, a, b = race
    a.publish(target)
    with pytest.raises(ckpt.CheckpointExistsError) as info:
        b.publish(target)
    _assert_lost(info, target)
    _loads(target, a)


def test_commits_cross_the_later_manifest_loses(race) -> None:
    """A writes its manifest, B then commits entirely, A's COMMIT comes last: B wins."""
    _, target, a, b = race
    with pytest.raises(ckpt.CheckpointExistsError) as info:
        a.publish(target, before_commit=lambda: b.publish(target))
    _assert_lost(info, target)
    _loads(target, b)


def test_loser_manifest_written_between_winner_writes(race) -> None:
    """B replaces manifest.json after A wrote it and then stops: A's commit repairs it."""
    _, target, a, b = race

    def b_writes_manifest_only() -> None:
        target.put(MANIFEST_KEY, b.raw)

    a.publish(target, before_commit=b_writes_manifest_only)
    _loads(target, a)


def test_loser_that_checked_before_the_commit_restores_the_winner(race) -> None:
    """B checked for COMMIT before A committed, then replaces manifest.json after A's
    commit and re-check: losing the COMMIT race, B puts A's manifest back."""
    _, target, a, b = race
    a.publish(target)
    blind = storage.open_store(target.url)
    blind.exists = lambda key: False  # B's look for COMMIT happened before A's commit
    with pytest.raises(ckpt.CheckpointExistsError) as info:
        b.publish(blind)
    _assert_lost(info, target)
    _loads(target, a)


SECOND_WRITER = textwrap.dedent("""
    import sys
    from relight import ckpt
    from tests.hardening._util import make_state
    ckpt.save(make_state(int(sys.argv[2])), sys.argv[1], step=2)
""")


def test_two_processes_race_through_the_manager(tmp_path, monkeypatch) -> None:
    """A real second process saves the same step while this one is between its manifest
    and its COMMIT: the other process wins, this save fails typed, nothing is lost."""
    from relight import ckpt

    root = storage.open_store(tmp_path / "run")
    mgr = ckpt.CheckpointManager(root, gc_grace_s=0.0)
    mgr.save(1, make_state(1), async_save=False)
    older = snapshot(root, step_dir(1))
    url = mgr.url_of(2)

    def publish_after_other(store, attempt, raw, marker, before_commit=None):
        def before() -> None:
            if before_commit is not None:
                before_commit()
            subprocess.run([sys.executable, "-c", SECOND_WRITER, url, "20"], check=True,
                           timeout=120, cwd=str(Path(__file__).resolve().parents[2]))
        publish_commit(store, attempt, raw, marker, before)

    monkeypatch.setattr(ckpt.commit, "publish_commit", publish_after_other)
    h = mgr.save(2, make_state(10), async_save=True)
    with pytest.raises(ckpt.CheckpointExistsError):
        h.wait()
    assert snapshot(root, step_dir(1)) == older
    got = zeros_like(make_state(20))
    ckpt.load(got, url)
    assert_bitwise(got, make_state(20))
    assert mgr.committed_steps() == [1, 2]
    assert mgr.restore(zeros_like(make_state(1))) == 2
    tally("bad_inputs")
    tally("checkpoints_checked", 2)
