"""A user's own loop with AdamW (examples/replica_user_loop.py), one process per replica
group against a real etcd: a group killed and replaced heals its weights and AdamW's
moments from a live group's memory (the replacement's fresh optimizer has no state until
its first step), a joiner whose state cannot take the heal is told why in its own loop and
costs the live groups at most one step, the survivor never restarts, and every group holds
bitwise the same weights after every step. Alone, the loop meets the chaos harness's
contract for a user's script: it checkpoints every interval and at its last step, and a
start with no live group resumes from the newest checkpoint as if it had never stopped
(scenarios/replica-user-loop.toml runs it under faults)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import relight
from tests.elastic.agents import ROOT, kill_sessions, wait_for
from tests.elastic.rdzv_util import job_id

pytestmark = [pytest.mark.etcd, pytest.mark.multirank]

EXAMPLE = ROOT / "examples" / "replica_user_loop.py"


def _events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _steps(path: Path, group: str, after: float = 0.0) -> list[dict]:
    return [e for e in _events(path) if e["group"] == group and e["ev"] == "step"
            and e["t"] > after]


@pytest.mark.timeout(300)
def test_a_users_adamw_loop_heals_and_a_mismatched_joiner_is_told(etcd_server,
                                                                  tmp_path) -> None:
    events = tmp_path / "events.jsonl"
    stop = tmp_path / "STOP"
    job = job_id()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs: dict[str, subprocess.Popen] = {}

    def start(name: str, group: str, *extra: str) -> subprocess.Popen:
        log = open(tmp_path / f"{name}.log", "wb")  # noqa: SIM115 - the child owns it
        procs[name] = subprocess.Popen(
            [sys.executable, str(EXAMPLE), "--etcd", etcd_server.endpoint, "--job", job,
             "--group", group, "--steps", "100000", "--min-groups", "2", "--step-s", "0.05",
             "--events", str(events), "--stop-file", str(stop), *extra],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
        return procs[name]

    def logs() -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-2500:]}"
                         for p in sorted(tmp_path.glob("*.log")))

    try:
        start("g0", "g0")
        start("g1", "g1")
        wait_for(lambda: all(len(_steps(events, g)) >= 5 for g in ("g0", "g1")), 120,
                 "two groups training\n" + logs())
        os.killpg(procs["g1"].pid, signal.SIGKILL)
        procs["g1"].wait(30)
        t_kill = time.time()
        wait_for(lambda: len(_steps(events, "g0", t_kill)) >= 5, 60,
                 "the survivor training alone\n" + logs())

        # The replacement: a new process, a fresh AdamW with no state yet.
        t_join = time.time()
        start("g1-new", "g1")
        wait_for(lambda: len(_steps(events, "g1", t_join)) >= 5, 120,
                 "the replacement healed and trained\n" + logs())

        # A joiner whose model is wider: its state cannot take the heal.
        t_bad = time.time()
        bad = start("g2-bad", "g2", "--width", "48")
        bad.wait(120)
        assert bad.returncode != 0
        errors = [e for e in _events(events) if e["group"] == "g2" and e["ev"] == "error"]
        assert len(errors) == 1 and errors[0]["type"] == "HealMismatchError", errors
        message = errors[0]["message"]  # names the tensor and both shapes
        assert "'model/0.bias' is [48]" in message and "[32]" in message, message
        assert "left the job" in message, message
        t_bad_done = time.time()
        wait_for(lambda: all(len(_steps(events, g, t_bad_done)) >= 5 for g in ("g0", "g1")),
                 60, "the live groups training on without the bad joiner\n" + logs())
        stop.write_text("stop")
        for name in ("g0", "g1-new"):
            procs[name].wait(60)
            assert procs[name].returncode == 0, logs()
    finally:
        kill_sessions(procs.values())

    evs = _events(events)
    # The survivor never restarted: one process for g0 from start to end.
    assert len({e["pid"] for e in evs if e["group"] == "g0"}) == 1
    # The replacement healed (it did not start from step 0 or from storage).
    first_new = _steps(events, "g1", t_join)[0]
    assert first_new["step"] > 5, first_new
    # Bitwise identical weights on every group after every step both committed.
    by_step: dict[int, set[str]] = {}
    for e in evs:
        if e["ev"] == "step":
            by_step.setdefault(e["step"], set()).add(e["digest"])
    assert all(len(d) == 1 for d in by_step.values()), \
        {s: d for s, d in by_step.items() if len(d) > 1}
    # Every sample of every step trained once: the groups of the quorum that committed
    # the step last (a step a dying group applied alone is redone by the survivors)
    # cover the global batch exactly.
    for step in by_step:
        done = [e for e in evs if e["ev"] == "step" and e["step"] == step]
        last = max(e["quorum"] for e in done)
        samples = sorted(i for e in done if e["quorum"] == last for i in e["samples"])
        assert samples == list(range(step * 12, step * 12 + 12)), (step, done)
    # The bad joiner cost each live group at most one step.
    for g in ("g0", "g1"):
        lost = [e for e in evs if e["group"] == g and e["ev"] == "abandoned"
                and t_bad <= e["t"] <= t_bad_done]
        assert len(lost) <= 1, lost
    # In a standing quorum a step asks etcd nothing.
    standing = [e["etcd_requests"] for e in evs if e["ev"] == "step" and e["group"] == "g0"]
    assert standing.count(0) >= len(standing) - 10, standing


@pytest.mark.timeout(180)
def test_ddp_buckets_summed_in_backward_give_the_same_weights(etcd_server, tmp_path) -> None:
    """The loop with its model in DDP and `register_ddp`: every step's gradients are summed
    across the groups by the bucket hook during backward, and the weights after every
    step are bitwise those of the same loop summing in `step()` (two jobs side by side,
    two groups each, the same seedless data by sample index)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs: dict[str, subprocess.Popen] = {}
    runs = {"ddp": ("--ddp",), "plain": ()}
    for run, extra in runs.items():
        job = job_id()
        for group in ("g0", "g1"):
            log = open(tmp_path / f"{run}-{group}.log", "wb")  # noqa: SIM115 - the child owns it
            procs[f"{run}-{group}"] = subprocess.Popen(
                [sys.executable, str(EXAMPLE), "--etcd", etcd_server.endpoint, "--job", job,
                 "--group", group, "--steps", "15", "--min-groups", "2",
                 "--events", str(tmp_path / f"{run}.jsonl"), *extra],
                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                start_new_session=True)
    try:
        for name, p in procs.items():  # each run ends at its last step
            p.wait(150)
            assert p.returncode == 0, (name, (tmp_path / f"{name}.log").read_text()[-3000:])
    finally:
        kill_sessions(procs.values())
    digests: dict[str, dict[int, set[int]]] = {}
    for run in runs:
        steps = [e for e in _events(tmp_path / f"{run}.jsonl") if e["ev"] == "step"]
        assert {e["in_backward"] for e in steps} == {run == "ddp"}, run
        assert all(e["size"] == 2 for e in steps), run
        for e in steps:
            digests.setdefault(run, {}).setdefault(e["step"], set()).add(e["digest"])
    assert sorted(digests["ddp"]) == list(range(15))
    assert digests["ddp"] == digests["plain"]  # one digest per step, the same in both
    assert all(len(d) == 1 for d in digests["ddp"].values())


@pytest.mark.timeout(180)
def test_the_loop_resumes_from_its_checkpoint_as_if_never_stopped(etcd_server,
                                                                    tmp_path) -> None:
    """The chaos harness's contract for a user's script, on one group: checkpoints every
    interval and at the last step; a new start with no live group restores the newest one
    (the optimizer's moments included) and continues at the next step, with the losses and
    the weights a run that never stopped has."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def run(name: str, ckpt: Path, steps: int) -> list[dict]:
        metrics = tmp_path / f"{name}.jsonl"
        out = subprocess.run(
            [sys.executable, str(EXAMPLE), "--etcd", etcd_server.endpoint, "--job", job_id(),
             "--group", "g0", "--ckpt", str(ckpt), "--metrics-path", str(metrics), "--steps",
             str(steps), "--ckpt-every", "5", "--replica.min_groups=1", "--unknown=1"],
            env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        return _events(metrics)

    first = run("first", tmp_path / "ckpt", 7)
    assert [r["step"] for r in first] == list(range(1, 8))
    assert all(r["restored_step"] is None for r in first)
    committed = relight.CheckpointManager(str(tmp_path / "ckpt")).committed_steps()
    assert committed == [5, 7], committed  # every interval and the last step
    resumed = run("resumed", tmp_path / "ckpt", 12)
    assert [r["step"] for r in resumed] == list(range(8, 13))
    assert {r["restored_step"] for r in resumed} == {7}
    fresh = run("fresh", tmp_path / "fresh", 12)
    for r in resumed:
        same = fresh[r["step"] - 1]
        assert (r["loss"], r["data_position"], r["state_crc"]) == (
            same["loss"], same["data_position"], same["state_crc"]), (r, same)
