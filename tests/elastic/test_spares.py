"""Hot spares under `relight run`: agents beyond `max_nodes` wait for as long as the
job lives, step into the next round when a member's node is lost, and exit 0 when the
job completes without needing them."""

from __future__ import annotations

import time

import pytest

from tests.elastic.agents import SCRIPTS, Agents, events, torchrun_cmd, wait_for
from tests.elastic.rdzv_util import job_id
from tests.elastic.test_failures import finish, steps, train_args, workers

pytestmark = [pytest.mark.etcd, pytest.mark.multirank]


def _node_of(agent) -> str:
    return f"-{agent.pid}-"


@pytest.mark.long
@pytest.mark.timeout(300)
def test_spares_step_in_for_a_lost_node_and_exit_0_at_the_end(etcd_server, tmp_path) -> None:
    run, agents = job_id(), Agents(tmp_path)
    # A join timeout shorter than the spares' wait: they must outlive it.
    cmd = torchrun_cmd(etcd_server.endpoint, run, "1:2", 1, SCRIPTS / "tiny_train.py",
                       train_args(tmp_path), max_restarts=3, launcher="relight",
                       conf={"join_timeout": "6"})
    try:
        a, b = agents.start(cmd, "node-a"), agents.start(cmd, "node-b")
        wait_for(lambda: len(steps(tmp_path, world=2)) >= 10, 120, "2 nodes training", agents)
        spare = agents.start(cmd, "spare-1")
        wait_for(lambda: [e for e in events(tmp_path) if e["ev"] == "rdzv_start"
                          and _node_of(spare) in e["node"]], 60, "the spare waiting", agents)
        time.sleep(8)  # past its 6 s join timeout
        assert spare.poll() is None, agents.logs()
        assert not workers(tmp_path, agent_pid=spare.pid), "the full group admitted a spare"

        # A member's node is lost: the spare takes its place in the next round.
        host = next(e["agent_pid"] for e in reversed(workers(tmp_path))
                    if e["group_rank"] == 0)
        victim, survivor = (a, b) if a.pid == host else (b, a)
        t_loss = time.time()
        agents.kill_node(victim)
        wait_for(lambda: [s for s in steps(tmp_path, world=2) if s["t"] > t_loss
                          and s["agent_pid"] == spare.pid], 60,
                 "the spare training in the re-formed group", agents)
        joined = min(e["t"] for e in events(tmp_path) if e["ev"] == "rdzv_done"
                     and _node_of(spare) in e["node"])
        print(f"\nspare in the next round {joined - t_loss:.2f}s after the node loss")
        # The lost node's 2 s lease, then one round: seconds, with slack for load.
        assert joined - t_loss < 2 + 10

        # A second spare waits until the job ends and then exits 0 too.
        idle = agents.start(cmd, "spare-2")
        wait_for(lambda: [e for e in events(tmp_path) if e["ev"] == "rdzv_start"
                          and _node_of(idle) in e["node"]], 60, "spare-2 waiting", agents)
        final = finish(agents, tmp_path, [survivor, spare, idle])
        assert final["step"] > 10
        assert not workers(tmp_path, agent_pid=idle.pid)
    finally:
        agents.close()
