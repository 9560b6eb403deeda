"""The S3 server (SeaweedFS) SIGKILLed in the middle of a save and restarted on the same
data dir: the committed checkpoint survives bitwise, the interrupted save leaves no
commit marker, and saving works again after the restart."""

from __future__ import annotations

import time

import pytest

from relight import ckpt, storage
from relight.chaos.s3_server import S3Server
from relight.ckpt.format import COMMIT_KEY
from relight.ckpt.root_layout import step_dir
from relight.storage.testing import FaultPlan, FaultyStore

from ._util import OPTIONS, TYPED, assert_bitwise, make_state, snapshot, tally, zeros_like

RETRY = storage.RetryPolicy(max_attempts=2, base_delay_s=0.05, max_delay_s=0.2)


@pytest.mark.long
@pytest.mark.s3
def test_s3_killed_mid_save_then_restarted(tmp_path, monkeypatch) -> None:
    server = S3Server(tmp_path / "s3-data")
    server.start()
    try:
        for key, value in server.env().items():
            monkeypatch.setenv(key, value)
        root = storage.open_store(server.url("run"), retry=RETRY)
        mgr = ckpt.CheckpointManager(root, options=OPTIONS)
        mgr.save(1, make_state(1), async_save=False)
        older = snapshot(root, step_dir(1))

        # Step 2's index put waits 2 s: the server is killed while the save is under way.
        slow = FaultyStore(root, FaultPlan(
            latency_s=2.0, ops=("put",), key_contains="/index/"))
        handle = ckpt.CheckpointManager(slow, options=OPTIONS).save(2, make_state(2))
        time.sleep(0.5)
        assert not handle.done()
        server.kill()
        with pytest.raises(TYPED):
            handle.wait(timeout=120)
        tally("faults_injected")

        server.start()
        assert mgr.committed_steps() == [1]
        assert not root.exists(f"{step_dir(2)}/{COMMIT_KEY}")
        assert snapshot(root, step_dir(1)) == older
        got = zeros_like(make_state(1))
        assert mgr.restore(got) == 1
        assert_bitwise(got, make_state(1))
        assert ckpt.verify(mgr.url_of(1)).ok

        # The same client goes on saving once the server is back.
        mgr.save(3, make_state(3), async_save=False)
        got = zeros_like(make_state(3))
        assert mgr.restore(got) == 3
        assert_bitwise(got, make_state(3))
        assert mgr.committed_steps() == [1, 3]
        tally("runs_completed")
        tally("checkpoints_checked", 2)
    finally:
        server.stop()
