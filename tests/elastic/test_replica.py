"""Healing in place: replica groups agree on a quorum per step in etcd, reduce across
groups on a process group rebuilt per quorum, and apply a step only when every member
voted. Survivors of a lost group keep training without a restart, a replacement heals
from a live group's memory, and every replica holds bitwise identical weights after
every step.

Pure protocol tests first (no etcd), then real processes (one per group, gloo) against a
3-member etcd cluster, with a group SIGKILLed and an etcd member killed mid-run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from relight.elastic.etcd_client import KeyValue
from relight.elastic.quorum import Quorum, Snapshot, decide_votes
from tests.elastic.agents import ROOT, SCRIPTS, events, kill_sessions, wait_for
from tests.elastic.rdzv_util import job_id

ROOT_KEY = "/p/job/replicas/"


def _kv(rel: str, value: str, mod: int = 1) -> KeyValue:
    return KeyValue(ROOT_KEY + rel, value.encode(), 1, mod, 1, 0)


def _snap(groups: list[str], quorum: Quorum | None, votes: dict[str, str],
          step: int = 5) -> Snapshot:
    kvs = [_kv(f"groups/{g}", json.dumps({"store": ["h", 1], "ready": True}))
           for g in groups]
    if quorum is not None:
        kvs.append(_kv("quorum", quorum.to_json().decode(), quorum.revision))
    kvs += [_kv(f"votes/{quorum.id if quorum else 0}/{step}/{g}", v)
            for g, v in votes.items()]
    return Snapshot.parse(kvs, ROOT_KEY, 100)


def test_decide_votes() -> None:
    q = Quorum(3, ("a", "b", "c"), 42)
    assert decide_votes(_snap(["a", "b", "c"], q, {"a": "ok", "b": "ok", "c": "ok"}), q, 5)
    # Every vote is in: commit, even if a member died since (its vote counts).
    assert decide_votes(_snap(["a", "b"], q, {"a": "ok", "b": "ok", "c": "ok"}), q, 5)
    assert decide_votes(_snap(["a", "b", "c"], q, {"a": "ok", "b": "fail"}), q, 5) is False
    # A member died before voting: its vote can never arrive.
    assert decide_votes(_snap(["a", "b"], q, {"a": "ok", "b": "ok"}), q, 5) is False
    # Still open: a live member has not voted yet.
    assert decide_votes(_snap(["a", "b", "c"], q, {"a": "ok"}), q, 5) is None
    # The quorum was replaced before the last vote: fenced, abandoned.
    newer = Quorum(4, ("a", "b"), 50)
    snap = _snap(["a", "b", "c"], newer, {})
    snap.votes[(3, 5)] = {"a": "ok", "b": "ok"}
    assert decide_votes(snap, q, 5) is False
    # Another step's votes do not count.
    assert decide_votes(_snap(["a", "b", "c"], q, {"a": "ok", "b": "ok", "c": "ok"}, 6),
                        q, 5) is None


def test_snapshot_refuses_garbage() -> None:
    from relight.elastic.quorum import QuorumError

    with pytest.raises(QuorumError, match="quorum"):
        Snapshot.parse([_kv("quorum", "not json")], ROOT_KEY, 1)


# -- real processes -----------------------------------------------------------------------

def _steps(out: Path, group: str) -> list[dict]:
    return [e for e in events(out) if e["ev"] == "step" and e["group"] == group]


@pytest.mark.etcd
@pytest.mark.multirank
# ~60-90 s on a quiet 2-core machine (four process starts); the bound is for a loaded one.
@pytest.mark.timeout(600)
def test_survivors_keep_training_through_a_lost_group(etcd_cluster, tmp_path) -> None:
    groups = ["g0", "g1", "g2"]
    stop = tmp_path / "STOP"  # the job's length, decided once the replacement trains
    job = job_id()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = {}
    logs = {}

    def start(g: str, log: str, *extra: str) -> subprocess.Popen:
        logs[log] = open(tmp_path / f"{log}.log", "wb")  # noqa: SIM115 - the child owns it
        return subprocess.Popen(
            [sys.executable, str(SCRIPTS / "replica_train.py"), "--endpoints",
             ",".join(etcd_cluster.endpoints), "--job", job, "--group", g, "--out",
             str(tmp_path), "--steps", "100000", "--stop-file", str(stop), "--min-groups",
             "3", "--state-mb", "32", *extra],
            stdout=logs[log], stderr=subprocess.STDOUT, env=env, cwd=ROOT,
            start_new_session=True)

    def logs_text() -> str:
        return "\n".join(f"--- {name}\n{(tmp_path / f'{name}.log').read_text()[-3000:]}"
                         for name in logs)

    try:
        for g in groups:
            procs[g] = start(g, g)

        wait_for(lambda: all(len(_steps(tmp_path, g)) >= 8 for g in groups), 120,
                 "three groups training together\n" + logs_text())
        # An etcd member (the leader) dies mid-run: it costs nothing. It is back (as an
        # operator would restart it) before the next fault.
        leader = etcd_cluster.leader()
        etcd_cluster.kill(leader)
        wait_for(lambda: all(len(_steps(tmp_path, g)) >= 14 for g in groups), 60,
                 "training on after the etcd leader's death\n" + logs_text())
        etcd_cluster.start_member(leader)
        # A whole group dies.
        t_kill = time.time()
        os.killpg(procs["g2"].pid, signal.SIGKILL)
        procs["g2"].wait(10)
        wait_for(lambda: len([e for e in _steps(tmp_path, "g0") if e["t"] > t_kill]) >= 8,
                 60, "the survivors training on\n" + logs_text())
        # Its replacement joins without state and heals from a live group's memory.
        t_join = time.time()
        procs["g2-new"] = start("g2", "g2-new", "--heal")
        wait_for(lambda: [e for e in events(tmp_path) if e["ev"] == "healed"], 120,
                 "the replacement healed\n" + logs_text())
        wait_for(lambda: len([e for e in _steps(tmp_path, "g2") if e["t"] > t_join]) >= 5,
                 60, "the replacement training\n" + logs_text())
        # A group frozen for longer than the collective timeout: left out, and told to
        # heal when it wakes (its restart would heal as g2's replacement did).
        os.killpg(procs["g1"].pid, signal.SIGSTOP)
        t_freeze = time.time()
        wait_for(lambda: [e for e in _steps(tmp_path, "g0") if e["t"] > t_freeze
                          and e["size"] == 2], 60, "g0 and g2 on without g1\n" + logs_text())
        os.killpg(procs["g1"].pid, signal.SIGCONT)
        procs["g1"].wait(60)
        assert procs["g1"].returncode != 0  # QuorumError: it must heal before training
        assert "must heal" in (tmp_path / "g1.log").read_text()
        steps = max(e["step"] for e in _steps(tmp_path, "g0")) + 10
        stop.write_text(str(steps))
        for g in ("g0", "g2-new"):
            procs[g].wait(240)
            assert procs[g].returncode == 0, logs_text()
    finally:
        kill_sessions(procs.values())
        for f in logs.values():
            f.close()

    evs = events(tmp_path)
    # Survivors never restarted: one start each; g2 twice (the lost one, its replacement).
    starts = [(e["group"], e["heal"]) for e in evs if e["ev"] == "start"]
    assert sorted(starts) == [("g0", False), ("g1", False), ("g2", False), ("g2", True)]
    by_group = {g: {e["step"]: e for e in _steps(tmp_path, g)} for g in ("g0",)}
    for g, got in by_group.items():
        assert sorted(got) == list(range(steps)), (g, sorted(got))
        assert len(_steps(tmp_path, g)) == steps  # each step applied once
    # g1's and g2's steps: the first process's, then its replacement's from the step it
    # healed at, each step at most once.
    healed = [e for e in evs if e["ev"] == "healed"]
    assert [e["group"] for e in healed] == ["g2"], healed
    for g in ("g1", "g2"):
        got = [e["step"] for e in _steps(tmp_path, g)]
        assert got == sorted(set(got)), (g, got)
    assert _steps(tmp_path, "g2")[-1]["step"] == steps - 1
    assert healed[0]["step"] in [e["step"] for e in _steps(tmp_path, "g2")]
    # The healed group received all of the state, not only what the steps change.
    done = [e for e in evs if e["ev"] == "done"]
    assert len(done) == 2 and len({e["extra"] for e in done}) == 1, done
    assert sorted(e["group"] for e in done) == ["g0", "g2"]
    assert len({json.dumps(e["w"]) for e in done}) == 1
    # Bitwise identical replicas after every step, the lost and the healed group too.
    for s in range(steps):
        digests = {e["digest"] for g in groups for e in _steps(tmp_path, g)
                   if e["step"] == s}
        assert len(digests) == 1, (s, digests)
    # Every sample of every step consumed exactly once, whatever the number of groups:
    # the committed update of step s summed the shares its quorum's members reduced
    # (logged before each reduction, so a member killed or frozen during or after it
    # counts too).
    for s in range(steps):
        committed = [e for g in groups for e in _steps(tmp_path, g) if e["step"] == s]
        assert len({e["quorum"] for e in committed}) == 1, (s, committed)
        q = committed[0]["quorum"]
        shares = {e["group"]: e["samples"] for e in evs if e["ev"] == "reduced"
                  and e["step"] == s and e["quorum"] == q}
        assert len(shares) == committed[0]["size"], (s, shares)
        used = sorted(i for share in shares.values() for i in share)
        assert used == list(range(s * 12, s * 12 + 12)), (s, used)

    def pause(t0: float, t1: float) -> float:
        """The longest gap between g0's committed steps in [t0, t1]."""
        ts = sorted(e["t"] for e in _steps(tmp_path, "g0"))
        before = max(t for t in ts if t <= t0)
        inside = [t for t in ts if t0 < t <= t1] + [min(t for t in ts if t > t1)]
        return max(b - a for a, b in zip([before, *inside], inside, strict=False))

    loss_pause = pause(t_kill, t_join)
    heal_t = next(e["t"] for e in healed)
    heal_pause = pause(heal_t - healed[0]["seconds"] - 0.5, heal_t)
    abandoned = [e for e in evs if e["ev"] == "abandoned"]
    join_s = heal_t - t_join
    print(f"\nsurvivors' pause after the group loss: {loss_pause:.2f}s; during the heal: "
          f"{heal_pause:.2f}s; replacement start -> healed {join_s:.2f}s (transfer "
          f"{healed[0]['seconds']:.3f}s, {healed[0]['bytes']} B); abandoned steps "
          f"{[(e['group'], e['step']) for e in abandoned]}")
    # The failover grace (1 s) + rebuilding the process group; slack for a loaded box.
    assert loss_pause < 1.0 + 6.0, loss_pause
    # Work lost per fault: at most the step in flight, on the group that never failed
    # (one for the loss of g2, one for the freeze of g1).
    assert len([e for e in abandoned if e["group"] == "g0"]) <= 2
    # Steps compute in the last step's quorum and agree before the reduction. A joiner
    # due mid-step waits for the next step boundary, so g0 kept the step it computed
    # when the replacement joined; it throws a step's computation away only when a
    # member is gone by then (the checks above hold redone steps to the same samples
    # and weights).
    discarded = [e for e in evs if e["ev"] == "discarded" and e["group"] == "g0"]
    assert not [e for e in discarded if t_join <= e["t"] <= heal_t + 2.0], discarded
    assert len(discarded) <= 2, discarded


class _ShardedGroups:
    """Replica groups of scripts/replica_sharded.py, each a torch.distributed world of
    its own (one port per group), against one etcd; a STOP file ends the run."""

    def __init__(self, tmp_path: Path, endpoint: str, *extra: str) -> None:
        self.tmp, self.endpoint, self.extra = tmp_path, endpoint, extra
        self.stop, self.job = tmp_path / "STOP", job_id()
        self.procs: dict[str, list[subprocess.Popen]] = {}
        self.logs: list = []

    def start(self, name: str, group: str, ranks: int, *extra: str) -> None:
        from relight.elastic.etcd_server import free_port

        port = free_port()
        self.procs[name] = []
        for rank in range(ranks):
            log = open(self.tmp / f"{name}-{rank}.log", "wb")  # noqa: SIM115 - child owns it
            self.logs.append(log)
            env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
                   "RANK": str(rank), "WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(port)}
            self.procs[name].append(subprocess.Popen(
                [sys.executable, str(SCRIPTS / "replica_sharded.py"), "--endpoints",
                 self.endpoint, "--job", self.job, "--group", group, "--out",
                 str(self.tmp), "--stop-file", str(self.stop), "--min-groups", "2",
                 *self.extra, *extra],
                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                start_new_session=True))

    def steps(self, group: str, rank: int = 0) -> list[dict]:
        return [e for e in events(self.tmp) if e["ev"] == "step" and e["group"] == group
                and e["rank"] == rank]

    def logs_text(self) -> str:
        return "\n".join(f"--- {f.name}\n{f.read_text()[-2500:]}"
                         for f in sorted(self.tmp.glob("*.log")))

    def until(self, pred, timeout: float, what: str) -> None:
        try:
            wait_for(pred, timeout, what)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.logs_text()}") from None

    def kill(self, name: str) -> None:
        for p in self.procs[name]:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)

    def finish(self, total: int, *names: str) -> None:
        """Ask for `total` steps and wait for `names` to exit 0."""
        self.stop.write_text(str(total))
        for name in names:
            for p in self.procs[name]:
                p.wait(240)
                assert p.returncode == 0, self.logs_text()

    def close(self) -> None:
        for group in self.procs.values():
            for p in group:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait(10)
        for f in self.logs:
            f.close()


@pytest.mark.long
@pytest.mark.etcd
@pytest.mark.multirank
# ~40 s on a quiet 2-core machine (six process starts); the bound is for a loaded one.
@pytest.mark.timeout(600)
def test_groups_of_two_ranks_heal_rank_by_rank(etcd_server, tmp_path) -> None:
    """Two groups of two ranks each (weights sharded over a group's ranks): a whole
    group is SIGKILLed, the survivor trains on alone, the replacement group heals each
    rank's shard from the same rank of the survivor, and every shard stays bitwise
    identical across groups after every step."""
    run = _ShardedGroups(tmp_path, etcd_server.endpoint)
    steps = run.steps
    try:
        run.start("g0", "g0", 2)
        run.start("g1", "g1", 2)
        run.until(lambda: all(len(steps(g, r)) >= 6 for g in ("g0", "g1") for r in (0, 1)),
                  120, "two groups of two ranks training")
        t_kill = time.time()
        run.kill("g1")
        run.until(lambda: len([e for e in steps("g0", 0) if e["t"] > t_kill]) >= 5, 60,
                  "g0 training on alone")
        run.start("g1-new", "g1", 2, "--heal")
        run.until(lambda: len([e for e in events(tmp_path) if e["ev"] == "healed"]) == 2,
                  120, "both ranks of the replacement healed")
        new = {p.pid for p in run.procs["g1-new"]}
        run.until(lambda: all(len([e for e in steps("g1", r) if e["pid"] in new]) >= 3
                              for r in (0, 1)), 60, "the replacement training")
        total = max(e["step"] for e in steps("g0", 0)) + 5
        run.finish(total, "g0", "g1-new")
    finally:
        run.close()

    evs = events(tmp_path)
    starts = sorted((e["group"], e["rank"], e["heal"]) for e in evs if e["ev"] == "start")
    assert starts == [("g0", 0, False), ("g0", 1, False), ("g1", 0, False),
                      ("g1", 0, True), ("g1", 1, False), ("g1", 1, True)]
    for r in (0, 1):
        got = [e["step"] for e in steps("g0", r)]
        assert got == list(range(total)), (r, got)  # the survivor: every step, once
        for s in range(total):
            digests = {e["digest"] for g in ("g0", "g1") for e in steps(g, r)
                       if e["step"] == s}
            assert len(digests) == 1, (r, s, digests)  # shards bitwise identical
    healed = [e for e in evs if e["ev"] == "healed"]
    assert sorted(e["rank"] for e in healed) == [0, 1] and len({e["step"] for e in healed}) == 1
    done = [e for e in evs if e["ev"] == "done"]
    for r in (0, 1):  # each rank's whole state, not only what the steps change
        assert len({e["extra"] for e in done if e["rank"] == r}) == 1, done
    for s in range(total):
        committed = [e for e in evs if e["ev"] == "step" and e["step"] == s]
        q = committed[0]["quorum"]
        assert {e["quorum"] for e in committed} == {q}, (s, committed)
        used = sorted(i for e in evs if e["ev"] == "reduced" and e["step"] == s
                      and e["quorum"] == q for i in e["samples"])
        assert used == list(range(s * 12, s * 12 + 12)), (s, used)


@pytest.mark.etcd
@pytest.mark.multirank
# ~45 s on a quiet 2-core machine (four process starts); the bound is for a loaded one.
@pytest.mark.timeout(600)
def test_groups_of_different_sizes_reduce_and_heal_by_region(etcd_server, tmp_path) -> None:
    """A group of two ranks (weights sharded in halves) and a group of one (the whole
    weights) train together: the reduction routes each half across the groups. The
    one-rank group is SIGKILLed and replaced by another one-rank group, which heals from
    the two-rank group's memory, resharded (each half from the rank that holds it). The
    whole weights stay bitwise identical across groups after every step, and every
    sample of every step is used once."""
    run = _ShardedGroups(tmp_path, etcd_server.endpoint, "--dtensor")
    steps = run.steps
    try:
        run.start("g0", "g0", 2)
        run.start("g1", "g1", 1)
        # Generous bounds: each waits for process starts (torch imports) and a few steps.
        run.until(lambda: len(steps("g0")) >= 6 and len(steps("g1")) >= 6, 180,
                  "a group of two ranks and a group of one training together")
        t_kill = time.time()
        run.kill("g1")
        run.until(lambda: len([e for e in steps("g0") if e["t"] > t_kill]) >= 3, 120,
                  "g0 training on alone")
        run.start("g1-new", "g1", 1, "--heal")
        run.until(lambda: any(e["ev"] == "healed" for e in events(tmp_path)), 180,
                  "the one-rank replacement healed from the two-rank group")
        new = {p.pid for p in run.procs["g1-new"]}
        run.until(lambda: len([e for e in steps("g1") if e["pid"] in new]) >= 3, 120,
                  "the replacement training")
        total = max(e["step"] for e in steps("g0")) + 4
        run.finish(total, "g0", "g1-new")
    finally:
        run.close()

    evs = events(tmp_path)
    for r in (0, 1):
        assert [e["step"] for e in steps("g0", r)] == list(range(total))
    committed = [e for e in evs if e["ev"] == "step"]
    for s in range(total):
        at = [e for e in committed if e["step"] == s]
        assert len({e["digest"] for e in at}) == 1, (s, at)  # whole weights, every group
        q = at[0]["quorum"]
        assert {e["quorum"] for e in at} == {q}, (s, at)
        # Two groups train in a mixed quorum (their layouts differ), one alone does not.
        assert all(e["mixed"] == (e["size"] == 2) for e in at), (s, at)
        used = sorted(i for e in evs if e["ev"] == "reduced" and e["step"] == s
                      and e["quorum"] == q for i in e["samples"])
        assert used == list(range(s * 12, s * 12 + 12)), (s, used)
    assert any(e["size"] == 2 for e in steps("g1") if e["pid"] not in new)
    assert any(e["size"] == 2 for e in steps("g1") if e["pid"] in new)
    healed = [e for e in evs if e["ev"] == "healed"]
    assert [(e["group"], e["rank"]) for e in healed] == [("g1", 0)]
    # The whole weights (both halves) and the plain tensor, once each.
    assert healed[0]["bytes"] == 8 * 8 + 4096 * 4, healed
    done = [e for e in evs if e["ev"] == "done"]
    assert len(done) == 3 and len({e["extra"] for e in done}) == 1, done


def test_members_whose_newest_vote_is_older_are_behind() -> None:
    """After a reduction that completed on b and c and failed on a: a voted on step 2,
    b and c (which applied 2) on step 3. a is behind and must heal; a joiner's vote, on
    whatever its own counter says, neither makes anyone behind nor counts as a holder."""
    from relight.elastic.quorum import _behind, _voted_steps

    q = Quorum(4, ("a", "b", "c"), 10)
    kvs = [_kv(f"groups/{g}", json.dumps({"store": ["h", 1], "ready": True}))
           for g in ("a", "b", "c")]
    kvs.append(_kv("groups/j", json.dumps({"store": ["h", 1], "ready": False, "heal": True})))
    kvs.append(_kv("quorum", q.to_json().decode(), q.revision))
    kvs += [_kv("votes/4/2/a", "fail"), _kv("votes/4/3/b", "fail"), _kv("votes/4/3/c", "fail"),
            _kv("votes/4/9/j", "fail"), _kv("votes/3/7/a", "fail")]
    snap = Snapshot.parse(kvs, ROOT_KEY, 100)
    assert _voted_steps(snap, q) == {"a": 2, "b": 3, "c": 3, "j": 9}  # quorum 3's ignored
    assert _behind(q, ("a", "b", "c", "j"), snap) == ("a",)
    # Everyone failed the same step: nobody applied it, nobody is behind.
    same = Snapshot.parse([*kvs[:5], _kv("votes/4/3/a", "fail"), _kv("votes/4/3/b", "fail")],
                          ROOT_KEY, 100)
    assert _behind(q, ("a", "b"), same) == ()
