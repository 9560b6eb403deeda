"""Notice sources and the pure decisions, in this process (no training): the signal
handler, the notice file, the AWS / GCP metadata poller against a local HTTP server that
starts announcing an interruption, the watcher's exits, go / no-go, the save estimate."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from relight.runtime.config import ConfigError, PreemptionConfig, load_config
from relight.runtime.preemption import (
    HUNG_EXIT_CODE,
    PREEMPTED_EXIT_CODE,
    FileSource,
    MetadataError,
    MetadataPoller,
    NoticeBoard,
    NoticeWatcher,
    SignalSource,
    decide,
    estimate_save_s,
    sources_from_config,
)
from tests.preemption.helpers import FakeMetadata

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def metadata() -> Iterator[FakeMetadata]:
    m = FakeMetadata()
    try:
        yield m
    finally:
        m.close()


def test_aws_poller_sees_the_interruption_once_announced(metadata: FakeMetadata) -> None:
    p = MetadataPoller("aws", metadata.url, interval_s=0.05, timeout_s=1.0, grace_s=30.0)
    assert p.probe() is None  # 404: no interruption scheduled
    when = metadata.announce(in_s=120)
    n = p.probe()
    assert n is not None and n.source == f"aws:{metadata.url}"
    assert n.deadline_unix == when.timestamp()  # AWS's own time, not grace_s
    assert 100 < n.remaining_s() <= 120
    # IMDSv2: one token PUT, reused; every GET carried it.
    puts = [r for r in metadata.requests if r[0] == "PUT"]
    gets = [r for r in metadata.requests if r[0] == "GET"]
    assert len(puts) == 1 and len(gets) == 2
    assert all(r[2].get("x-aws-ec2-metadata-token") == metadata.token for r in gets)


def test_gcp_poller_thread_posts_when_preempted_turns_true(metadata: FakeMetadata) -> None:
    board = NoticeBoard()
    p = MetadataPoller("gcp", metadata.url, interval_s=0.05, timeout_s=1.0, grace_s=25.0)
    p.start(board)
    try:
        time.sleep(0.3)
        assert not board.pending and p.requests >= 2
        metadata.announce()
        deadline = time.monotonic() + 10
        while not board.pending and time.monotonic() < deadline:
            time.sleep(0.02)
        assert board.pending
        n = board.first
        assert n is not None and n.detail == "preempted=TRUE"
        assert 24 < n.remaining_s() <= 25
        assert all(r[2].get("metadata-flavor") == "Google" for r in metadata.requests)
    finally:
        p.stop()
    assert not p._thread.is_alive()  # type: ignore[union-attr]


def test_poller_errors_are_typed_and_do_not_post(metadata: FakeMetadata) -> None:
    p = MetadataPoller("aws", metadata.url, interval_s=0.05, timeout_s=1.0, grace_s=30.0)
    assert p.probe() is None
    metadata.token = "rotated"
    with pytest.raises(MetadataError, match="401"):
        p.probe()  # the cached token is refused ...
    assert p.probe() is None  # ... dropped, and a fresh one fetched
    unreachable = MetadataPoller("gcp", "http://127.0.0.1:9", interval_s=0.05, timeout_s=0.5,
                                 grace_s=30.0)
    with pytest.raises(OSError):
        unreachable.probe()
    board = NoticeBoard()
    unreachable.start(board)
    time.sleep(0.3)
    unreachable.stop()
    assert not board.pending and unreachable.errors >= 1


def test_poller_is_off_unless_configured() -> None:
    assert PreemptionConfig().metadata == "" and PreemptionConfig().metadata_url == ""
    kinds = [type(s).__name__ for s in sources_from_config(PreemptionConfig())]
    assert kinds == ["SignalSource"]
    with pytest.raises(ConfigError, match="metadata_url must be set"):
        PreemptionConfig(metadata="aws")
    with pytest.raises(ConfigError, match="http"):
        PreemptionConfig(metadata="gcp", metadata_url="169.254.169.254")
    with pytest.raises(ConfigError, match="unknown signal"):
        load_config(None, ["--preemption.signals=SIGTERM,SIGNOPE"])
    assert sources_from_config(PreemptionConfig(enabled=False, notice_file="/x")) == []


def test_signal_source_posts_and_restores_the_previous_handler() -> None:
    board = NoticeBoard()
    before = signal.getsignal(signal.SIGUSR1)
    src = SignalSource([signal.SIGUSR1], grace_s=7.0)
    src.start(board)
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR1)  # a second notice is recorded, not fatal
        time.sleep(0.05)
    finally:
        src.stop()
    assert board.count == 2
    n = board.first
    assert n is not None and n.source == "signal:SIGUSR1" and 6 < n.remaining_s() <= 7
    assert signal.getsignal(signal.SIGUSR1) == before


def test_file_source_checks_once_per_call(tmp_path: Path) -> None:
    board = NoticeBoard()
    src = FileSource(str(tmp_path / "preempt"), grace_s=10.0)
    src.start(board)
    src.check()
    assert not board.pending
    (tmp_path / "preempt").touch()
    src.check()
    src.check()
    assert board.count == 1 and board.first is not None
    assert board.first.source == f"file:{tmp_path / 'preempt'}"


def _watcher(cfg: PreemptionConfig, exits: list[int]) -> NoticeWatcher:
    src = SignalSource([signal.SIGUSR2], grace_s=cfg.grace_s)
    return NoticeWatcher(cfg, sources=[src], exit_fn=exits.append)


def test_watcher_exits_at_once_on_a_notice_before_training() -> None:
    exits: list[int] = []
    w = _watcher(PreemptionConfig(), exits).start()
    try:
        os.kill(os.getpid(), signal.SIGUSR2)
        deadline = time.monotonic() + 5
        while not exits and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        w.stop()
    assert exits == [PREEMPTED_EXIT_CODE]


def test_watcher_exits_when_the_step_in_flight_hangs_after_a_notice() -> None:
    exits: list[int] = []
    w = _watcher(PreemptionConfig(step_timeout_s=0.3), exits).start()
    try:
        w.phase = "training"
        w.step_done(1, 0.01)
        os.kill(os.getpid(), signal.SIGUSR2)
        time.sleep(0.1)
        assert exits == []  # the step may still finish
        deadline = time.monotonic() + 5
        while not exits and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        w.stop()
    assert exits == [HUNG_EXIT_CODE]


def test_watcher_leaves_the_emergency_phase_alone() -> None:
    exits: list[int] = []
    w = _watcher(PreemptionConfig(step_timeout_s=0.1), exits).start()
    try:
        w.phase = "emergency"
        os.kill(os.getpid(), signal.SIGUSR2)
        time.sleep(0.4)
    finally:
        w.stop()
    assert exits == [] and w.board.count == 1


def test_decide_is_the_same_from_the_same_gathered_values() -> None:
    go = decide([0.5, 2.0], [30.0, 10.0], safety_factor=1.5, margin_s=1.0)
    assert go.save and go.estimate_s == 2.0 and go.remaining_s == 10.0
    nogo = decide([0.5, 7.0], [30.0, 10.0], safety_factor=1.5, margin_s=1.0)
    assert not nogo.save and "exceeds" in nogo.reason
    assert decide([6.0], [10.0], safety_factor=1.5, margin_s=1.0).save  # 6*1.5+1 == 10


def test_estimate_uses_the_runs_own_saves_scaled_to_the_state() -> None:
    assert estimate_save_s(200_000_000, [], 100.0, 1.0) == pytest.approx(3.0)
    # the slowest observed save wins, scaled linearly to the bytes now
    est = estimate_save_s(2_000, [(1_000, 0.5), (1_000, 0.8)], 100.0)
    assert est == pytest.approx(1.6)
