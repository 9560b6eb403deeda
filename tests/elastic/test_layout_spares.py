"""Node counts the layout cannot use: a round trains on the largest count it can and the
other nodes wait as hot spares (no restart loop), stepping in at the next loss or when
enough newcomers make a larger usable group. `relight run` reads the usable counts from
the training config and says in one line which sizes train and which wait."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous import RendezvousInfo

from relight.elastic.launch import TrainingHints, _add_node_counts, usable_node_counts
from relight.elastic.rendezvous import RendezvousSettings, parse_node_counts
from relight.runtime.config import load_config
from relight.runtime.launch_hints import layout_refusal, training_hints
from tests.elastic.rdzv_util import handler, in_thread, job_id, shutdown_all

ROOT = Path(__file__).resolve().parents[2]


# -- pure parts ----------------------------------------------------------------

def test_fit_is_the_largest_usable_count() -> None:
    from relight.elastic.etcd_client import EtcdSettings

    s = RendezvousSettings(run_id="j", min_nodes=1, max_nodes=4, etcd=EtcdSettings(
        endpoints=("127.0.0.1:2379",)), node_counts=(2, 4))
    assert [s.fit(n) for n in range(0, 7)] == [0, 0, 2, 2, 4, 4, 4]
    anything = RendezvousSettings(run_id="j", min_nodes=1, max_nodes=3, etcd=EtcdSettings(
        endpoints=("127.0.0.1:2379",)))
    assert [anything.fit(n) for n in range(0, 5)] == [0, 1, 2, 3, 3]
    assert parse_node_counts("4+2+4") == (2, 4) and parse_node_counts(None) is None
    assert parse_node_counts(3) == (3,)
    with pytest.raises(ValueError, match="node_counts='2,x'"):
        parse_node_counts("2,x")


def test_layout_refusal_is_the_trainers_check() -> None:
    """tp=4 over nodes of 2 ranks: odd node counts cannot train. The main job's batch
    (16 in micro-batches of 8) fits every count: uneven shares, no spares."""
    why = layout_refusal(load_config(ROOT / "configs/tiny.toml", ["--parallel.tp=4"]))
    assert why(8) is None and "not divisible by pp*dp_replicate*tp" in why(6)
    usable, unfit = usable_node_counts(2, 4, 2, why)
    assert usable == [2, 4] and list(unfit) == [3]
    main = training_hints(["--module", "relight.runtime.train", "--config",
                           str(ROOT / "configs/text.toml")])
    assert main is not None and main.layout_refusal is not None
    assert usable_node_counts(1, 8, 1, main.layout_refusal) == (list(range(1, 9)), {})


def test_relight_run_passes_the_counts_and_says_so(capsys) -> None:  # noqa: ANN001
    why = layout_refusal(load_config(ROOT / "configs/tiny.toml", ["--parallel.tp=4"]))
    args = argparse.Namespace(nproc_per_node="2", nnodes="2:4", rdzv_conf="lease_ttl=3")
    _add_node_counts(args, TrainingHints(None, None, why))
    assert args.rdzv_conf == "lease_ttl=3,node_counts=2+4"
    line = capsys.readouterr().err.strip()
    assert "\n" not in line
    assert line.startswith("relight run: the layout trains on 2 or 4 node(s) of 2 ranks, "
                           "not on 3 (world 6: world size 6 is not divisible")
    assert line.endswith("3 up: 2 train, 1 wait as hot spares")
    # A user's own list is kept; a layout every count fits adds nothing.
    own = argparse.Namespace(nproc_per_node="2", nnodes="2:4", rdzv_conf="node_counts=4")
    _add_node_counts(own, TrainingHints(None, None, why))
    assert own.rdzv_conf == "node_counts=4"
    fits = argparse.Namespace(nproc_per_node="2", nnodes="1:4", rdzv_conf="")
    _add_node_counts(fits, TrainingHints(None, None, lambda world: None))
    assert fits.rdzv_conf == "" and not capsys.readouterr().err


# -- against a real etcd -------------------------------------------------------

def _wait(cond, timeout: float, what: str) -> None:  # noqa: ANN001
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.etcd
@pytest.mark.timeout(120)
def test_unusable_sizes_leave_hot_spares_not_a_restart_loop(etcd_server) -> None:
    """Usable counts 2 and 4 of 1:4. Three nodes: two train, one waits, and the two see
    nobody waiting (torchrun would restart them otherwise). A fourth node makes four
    usable: all four train. One is lost: three are left, two train, one waits again."""
    run = job_id()

    def node():  # noqa: ANN202
        return handler(etcd_server.endpoint, run, 1, 4, node_counts="2+4",
                       last_call_timeout="2")

    hs = [node() for _ in range(3)]
    late = node()
    try:
        joins = [in_thread(h.next_rendezvous) for h in hs]
        _wait(lambda: sum(bool(out) for _, out in joins) == 2, 40, "two nodes to train")
        time.sleep(1.0)
        trained = [h for h, (_, out) in zip(hs, joins, strict=True) if out]
        spare = next(h for h, (_, out) in zip(hs, joins, strict=True) if not out)
        infos = [out[0] for _, out in joins if out]
        assert all(isinstance(i, RendezvousInfo) and i.world_size == 2 for i in infos), infos
        assert sorted(i.rank for i in infos) == [0, 1]
        # No restart loop: the training nodes see nobody they should re-form for.
        t0 = time.monotonic()
        while time.monotonic() - t0 < 3:
            assert [h.num_nodes_waiting() for h in trained] == [0, 0]
            time.sleep(0.2)

        # A fourth node: with the spare that makes 4, a usable size: everyone re-forms.
        late_join = in_thread(late.next_rendezvous)
        _wait(lambda: all(h.num_nodes_waiting() > 0 for h in trained), 30,
              "the training nodes to see the larger group")
        rejoins = [in_thread(h.next_rendezvous) for h in trained]
        for t, _ in [*rejoins, late_join, joins[hs.index(spare)]]:
            t.join(40)
        four = [out[0] for _, out in [*rejoins, late_join, joins[hs.index(spare)]]]
        assert all(isinstance(i, RendezvousInfo) and i.world_size == 4 for i in four), four
        assert sorted(i.rank for i in four) == [0, 1, 2, 3]

        # A node is lost: three are left, two train, one waits as a hot spare.
        group = [*trained, late, spare]
        lost = group.pop(1)
        assert lost.leave("test: node lost")
        _wait(lambda: all(h.num_nodes_waiting() > 0 for h in group), 30,
              "the survivors to see the loss")
        again = [in_thread(h.next_rendezvous) for h in group]
        _wait(lambda: sum(bool(out) for _, out in again) == 2, 40, "two survivors to train")
        time.sleep(1.0)
        assert sum(bool(out) for _, out in again) == 2, "a third node was admitted"
        assert {out[0].world_size for _, out in again if out} == {2}
        waiting = [h for h, (_, out) in zip(group, again, strict=True) if not out]
        assert len(waiting) == 1
    finally:
        shutdown_all([*hs, late])


# -- under `relight run`, with the trainer -------------------------------------

@pytest.mark.long  # three agents and a restart: about a minute on two cores
@pytest.mark.multirank
@pytest.mark.etcd
@pytest.mark.timeout(300)
def test_relight_run_keeps_a_node_the_layout_cannot_use_as_a_spare(etcd_server,
                                                                  tmp_path) -> None:
    """tp = 2 over nodes of one rank, three nodes up: two train, the third waits (no
    worker, no restart loop); a training node is lost and the spare steps in; the job
    reaches its last step and every agent exits 0."""
    import json
    import sys

    from tests.elastic.agents import RDZV_CONF, Agents, events, wait_for

    run, agents = job_id(), Agents(tmp_path)
    metrics = tmp_path / "metrics.jsonl"
    conf = ",".join(f"{k}={v}" for k, v in RDZV_CONF.items())
    cmd = [sys.executable, "-c",
           "import sys; from relight.cli import main; sys.exit(main(['run', *sys.argv[1:]]))",
           f"--rdzv-endpoint={etcd_server.endpoint}", f"--rdzv-id={run}", "--nnodes=1:3",
           "--nproc-per-node=1", "--max-restarts=3", "--monitor-interval=0.1",
           f"--rdzv-conf={conf}", "--", sys.executable, "-m", "relight.runtime.train",
           "--config", str(ROOT / "configs/tiny.toml"), "--parallel.tp=2",
           "--train.steps=150", "--checkpoint.every=10", f"--checkpoint.url={tmp_path / 'ck'}",
           f"--train.metrics_path={metrics}", "--train.log_every=50",
           "--train.collective_timeout_s=20", "--train.watchdog_timeout_s=60"]

    def records() -> list[dict]:
        if not metrics.exists():
            return []
        return [json.loads(line) for line in metrics.read_text().splitlines() if line]

    def rounds(agent) -> list[dict]:  # noqa: ANN001
        return [e for e in events(tmp_path) if e["ev"] == "rdzv_done"
                and f"-{agent.pid}-" in e["node"]]

    try:
        nodes = [agents.start(cmd, f"node-{i}") for i in range(3)]
        wait_for(lambda: len(records()) >= 10, 120, "two nodes training", agents)
        trained = [a for a in nodes if rounds(a)]
        spare = next(a for a in nodes if not rounds(a))
        assert len(trained) == 2 and spare.poll() is None, agents.logs()
        line = "relight run: the layout trains on 2 node(s) of 1 ranks, not on 1, 3"
        assert line in (tmp_path / "node-0.log").read_text(), agents.logs()
        assert "wait as hot spares" in agents.logs()
        time.sleep(2)
        assert not rounds(spare), "the spare was admitted to a group the layout cannot use"
        assert all(len(rounds(a)) == 1 for a in trained), "the training nodes restarted"

        agents.kill_node(trained[0])
        wait_for(lambda: rounds(spare), 60, "the spare stepping in", agents)
        for a in (trained[1], spare):
            a.wait(180)
        assert (trained[1].returncode, spare.returncode) == (0, 0), agents.logs()
        recs = records()
        assert recs[-1]["step"] == 150
        assert {r["world_size"] for r in recs} == {2}
    finally:
        agents.close()
