"""A round's store host dies while the other agents assign worker ranks through it.

The round's rank 0 node (a separate process holding the round's TCPStore) is SIGKILLed
once the other node has joined the round and is blocked in torchrun's
`_assign_worker_ranks`. torchrun's own agent lets the store error escape (the job dies:
chaos preemptible-fleet seed 8); `RelightAgent` opens a new round and forms it
without the dead node.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from torch.distributed import DistError
from torch.distributed.elastic.agent.server.api import WorkerSpec
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

from relight.elastic.agent import RelightAgent, installed
from relight.elastic.etcd_client import EtcdClient, EtcdSettings
from relight.elastic.rendezvous import add_listener, remove_listener
from tests.elastic.rdzv_util import handler, job_id

# Two nodes at most, and a last call long enough that the first never forms alone.
_CONF = {"last_call_timeout": "60"}

_LEADER = """
import sys, time
from tests.elastic.rdzv_util import handler
h = handler(sys.argv[1], sys.argv[2], 1, 2, last_call_timeout="60")
print(h.node_id, flush=True)
info = h.next_rendezvous()
print(info.rank, flush=True)
time.sleep(600)  # holds the round's TCPStore; never assigns ranks
"""


def _wait_member(client: EtcdClient, run: str, node: str) -> None:
    deadline = time.monotonic() + 30
    while True:
        kv = client.get(f"/relight-test/{run}/state")
        if kv and node in kv.json().get("members", []):
            return
        assert time.monotonic() < deadline, "the leader node never joined"
        time.sleep(0.1)


@pytest.mark.parametrize("agent_class", [LocalElasticAgent, RelightAgent])
def test_store_host_killed_during_rank_assignment(etcd_server, tmp_path, agent_class) -> None:
    run = job_id()
    leader = subprocess.Popen([sys.executable, "-c", _LEADER, etcd_server.endpoint, run],
                              stdout=subprocess.PIPE, text=True, start_new_session=True,
                              cwd=os.getcwd())
    client = EtcdClient(EtcdSettings(endpoints=(etcd_server.endpoint,)))
    follower = handler(etcd_server.endpoint, run, 1, 2, **_CONF)
    events: list[tuple[str, dict]] = []
    killed = threading.Event()

    def kill_leader_once_joined(kind: str, fields: dict) -> None:
        events.append((kind, fields))
        if kind == "rdzv_done" and fields.get("round") == 0 and not killed.is_set():
            killed.set()
            # Let the follower reach its blocking `store.get` of the assigned ranks.
            threading.Timer(0.5, os.killpg, (leader.pid, signal.SIGKILL)).start()

    spec = WorkerSpec(role="trainer", local_world_size=1, rdzv_handler=follower,
                      entrypoint=sys.executable, args=("-c", "pass"))
    agent = agent_class(spec, logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path)))
    add_listener(kill_leader_once_joined)
    try:
        _wait_member(client, run, leader.stdout.readline().strip())
        group = agent._worker_group
        if agent_class is LocalElasticAgent:
            with pytest.raises(DistError):
                agent._rendezvous(group)
            assert killed.is_set()
            return
        agent._rendezvous(group)
        assert killed.is_set()
        assert leader.stdout.readline().strip() == "0", "the killed node was not rank 0"
        assert (group.group_rank, group.group_world_size) == (0, 1)
        assert [w.global_rank for w in group.workers] == [0]
        lost = [f for k, f in events if k == "rdzv_store_lost"]
        assert len(lost) == 1 and lost[0]["run_id"] == run
        assert [f["round"] for k, f in events if k == "rdzv_done"] == [0, 1]
    finally:
        remove_listener(kill_leader_once_joined)
        if leader.poll() is None:
            os.killpg(leader.pid, signal.SIGKILL)
        leader.wait(10)
        follower.shutdown()


def test_installed_swaps_the_launchers_agent_and_restores_it() -> None:
    import torch.distributed.launcher.api as launcher

    with installed():
        assert launcher.LocalElasticAgent is RelightAgent
    assert launcher.LocalElasticAgent is LocalElasticAgent
