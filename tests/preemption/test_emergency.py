"""The emergency checkpoint with real training processes (gloo, CPU, torchrun).

* a notice file -> every rank stops after the same step, commits it, exits 76; the resume
  starts from that step (zero lost) and ends bitwise equal to an uninterrupted run;
* SIGTERM to one worker of a 2-rank torchrun job -> both ranks save the same step;
* the metadata poller in a training run, against a local server that starts announcing;
* a second notice during the emergency save, then SIGKILL before its commit marker ->
  no half-committed checkpoint, the previous one is the newest and loads.
"""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

import pytest
import torch

from relight.runtime.preemption import PREEMPTED_EXIT_CODE
from tests.preemption.helpers import (
    TINY,
    FakeMetadata,
    env,
    job,
    latest_step,
    metrics,
    read_state,
    single,
    torchrun,
    wait_until,
)

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(400)]


def _preempted_lines(text: str) -> dict[int, int]:
    """rank -> step of each worker's final 'preempted ... exiting with status 76' line."""
    out = {}
    for m in re.finditer(r"\[rank (\d+) step (\d+)\] preempted .*exiting with status (\d+)",
                         text):
        assert int(m.group(3)) == PREEMPTED_EXIT_CODE
        out[int(m.group(1))] = int(m.group(2))
    return out


def test_notice_file_gives_zero_lost_steps_and_a_bitwise_equal_resume(tmp_path: Path) -> None:
    steps = 12
    ref_url, url = str(tmp_path / "ref"), str(tmp_path / "ck")
    notice = tmp_path / "preempt-now"
    m_ref, m1, m2 = (tmp_path / f"m-{n}.jsonl" for n in ("ref", "1", "2"))
    common = [*TINY, f"--train.steps={steps}", "--checkpoint.every=4"]
    with job(torchrun(2, [*common, f"--checkpoint.url={ref_url}",
                          f"--train.metrics_path={m_ref}"]), tmp_path / "ref.log") as ref, \
         job(torchrun(2, [*common, f"--checkpoint.url={url}", f"--train.metrics_path={m1}",
                          f"--preemption.notice_file={notice}"]), tmp_path / "1.log") as run:
        wait_until(lambda: len(metrics(m1)) >= 5, 240, "step 5", run)
        notice.touch()
        assert run.wait(60) != 0  # torchrun: a worker exited non-zero
        assert ref.wait(240) == 0, ref.text()[-3000:]
    logged = metrics(m1)
    stopped = logged[-1]["step"]
    assert 5 <= stopped < steps
    # Each rank's watcher polls the file on its own clock: the step's agreement may come
    # when only one has seen it (a full CI run saw [1]); one is enough to stop both.
    assert logged[-1]["preempt_notice_ranks"] in ([0], [1], [0, 1])
    assert not any("preempt_notice_ranks" in r for r in logged[:-1])
    text = (tmp_path / "1.log").read_text()
    assert _preempted_lines(text) == {0: stopped, 1: stopped}
    assert f"exitcode  : {PREEMPTED_EXIT_CODE}" in text
    assert latest_step(url) == stopped  # the step in flight was finished and committed

    notice.unlink()
    with job(torchrun(2, [*common, f"--checkpoint.url={url}", f"--train.metrics_path={m2}"]),
             tmp_path / "2.log") as resume:
        assert resume.wait(240) == 0, resume.text()[-3000:]
    resumed = metrics(m2)
    assert resumed[0]["restored_step"] == stopped  # zero lost steps
    assert [r["step"] for r in resumed] == list(range(stopped + 1, steps + 1))
    ref_losses = {r["step"]: r["loss"] for r in metrics(m_ref)}
    assert all(r["loss"] == ref_losses[r["step"]] for r in logged + resumed)
    a, b = read_state(url, steps), read_state(ref_url, steps)
    assert a.keys() == b.keys() and len(a) > 10
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_sigterm_to_one_worker_stops_every_rank_at_the_same_step(tmp_path: Path) -> None:
    url, m = str(tmp_path / "ck"), tmp_path / "m.jsonl"
    args = [*TINY, "--train.steps=200", "--checkpoint.every=100", f"--checkpoint.url={url}",
            f"--train.metrics_path={m}"]
    with job(torchrun(2, args), tmp_path / "run.log") as run:
        wait_until(lambda: len(metrics(m)) >= 3, 240, "step 3", run)
        workers = run.workers()
        assert sorted(workers) == [0, 1]
        workers[1].send_signal(signal.SIGTERM)  # rank 1 only: rank 0 learns it by the gather
        assert run.wait(60) != 0
    logged = metrics(m)
    stopped = logged[-1]["step"]
    assert logged[-1]["preempt_notice_ranks"] == [1]
    text = run.text()
    assert _preempted_lines(text) == {0: stopped, 1: stopped}
    committed = re.findall(r"\[rank (\d) step (\d+)\] preemption: emergency checkpoint "
                           r"committed step (\d+)", text)
    assert sorted(committed) == [("0", str(stopped), str(stopped)),
                                 ("1", str(stopped), str(stopped))]
    assert latest_step(url) == stopped


@pytest.mark.long  # pollers: test_sources.py; the notice path end to end: the notice-file test
def test_metadata_poller_in_a_training_run(tmp_path: Path) -> None:
    url, m = str(tmp_path / "ck"), tmp_path / "m.jsonl"
    server = FakeMetadata()
    try:
        args = [*TINY, "--train.steps=200", "--checkpoint.every=100",
                f"--checkpoint.url={url}", f"--train.metrics_path={m}",
                "--preemption.metadata=aws", f"--preemption.metadata_url={server.url}",
                "--preemption.poll_interval_s=0.1"]
        with job(single(args), tmp_path / "run.log") as run:
            wait_until(lambda: len(metrics(m)) >= 2, 180, "step 2", run)
            assert run.proc.poll() is None
            server.announce(in_s=120)
            assert run.wait(60) == PREEMPTED_EXIT_CODE, run.text()[-3000:]
    finally:
        server.close()
    stopped = metrics(m)[-1]["step"]
    assert latest_step(url) == stopped
    assert f"preemption notice from aws:{server.url}: instance-action terminate" in run.text()


@pytest.mark.long
def test_kill_during_the_emergency_save_leaves_no_half_committed_checkpoint(
        tmp_path: Path) -> None:
    url, m = str(tmp_path / "ck"), tmp_path / "m.jsonl"
    plan = tmp_path / "fault-plan.json"
    base = [*TINY, "--train.steps=200", "--checkpoint.every=1000", f"--checkpoint.url={url}"]
    # 1. a committed checkpoint to fall back to (one process; the next run reshards it).
    with job(single([*base, "--train.stop_at=2"]), tmp_path / "0.log") as first:
        assert first.wait(180) == 0, first.text()[-3000:]
    assert latest_step(url) == 2
    # 2. 2 ranks resume from it; only the emergency save writes a COMMIT marker, and the
    #    fault plan holds that write back: every index and the manifest get written.
    plan.write_text(json.dumps({"latency_s": 120.0, "ops": ["put"],
                                "key_contains": "/COMMIT"}))
    environ = env(RELIGHT_FAULT_PLAN=f"@{plan}")
    with job(torchrun(2, [*base, f"--train.metrics_path={m}"]), tmp_path / "1.log",
             environ) as run:
        wait_until(lambda: len(metrics(m)) >= 2, 240, "2 steps after the restore", run)
        assert metrics(m)[0]["restored_step"] == 2
        workers = run.workers()
        workers[0].send_signal(signal.SIGTERM)
        wait_until(lambda: "emergency save of step" in run.text(), 60, "the emergency save",
                   run)
        stopped = metrics(m)[-1]["step"]
        manifest = Path(url) / f"step-{stopped:012d}" / "manifest.json"
        wait_until(manifest.exists, 60, "the emergency save's manifest", run)
        for w in workers.values():  # a second notice: logged, the save goes on
            w.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        assert all(w.is_running() and w.status() != "zombie" for w in workers.values())
        assert "already acting on an earlier one" in run.text()
    # `job` SIGKILLed the whole group: the grace period is over.
    assert stopped > 2
    assert manifest.exists() and not (manifest.parent / "COMMIT").exists()
    assert latest_step(url) == 2
    # 3. the previous checkpoint is the one a restart loads.
    m2 = tmp_path / "m2.jsonl"
    with job(single([*base, "--train.stop_at=3", f"--train.metrics_path={m2}"]),
             tmp_path / "2.log") as again:
        assert again.wait(180) == 0, again.text()[-3000:]
    assert [(r["restored_step"], r["step"]) for r in metrics(m2)] == [(2, 3)]


def test_emergency_save_is_skipped_when_it_cannot_fit_the_grace(tmp_path: Path) -> None:
    url, m, notice = str(tmp_path / "ck"), tmp_path / "m.jsonl", tmp_path / "notice"
    # 0.5 s of grace cannot hold any save (1 s margin alone): the run must say it falls
    # back to the newest committed checkpoint, write nothing more, and still exit 76.
    args = [*TINY, "--train.steps=200", "--checkpoint.every=2", f"--checkpoint.url={url}",
            f"--train.metrics_path={m}", f"--preemption.notice_file={notice}",
            "--preemption.grace_s=0.5"]
    with job(single(args), tmp_path / "run.log") as run:
        wait_until(lambda: latest_step(url) is not None and len(metrics(m)) >= 3, 180,
                   "a committed checkpoint and step 3", run)
        notice.touch()
        assert run.wait(60) == PREEMPTED_EXIT_CODE, run.text()[-3000:]
    stopped = metrics(m)[-1]["step"]
    committed = latest_step(url)
    assert committed is not None and committed < stopped
    assert not (Path(url) / f"step-{stopped:012d}").exists()
    assert (f"skipping the emergency save; the resume will use the newest committed "
            f"checkpoint, step {committed} ({stopped - committed} steps lost)") in run.text()
