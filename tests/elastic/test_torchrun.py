"""torchrun with --rdzv-backend=relight-etcd: two agents (separate processes) run a
small gloo job together (one worker each: a worker costs ~2 s of torch import here)."""

from __future__ import annotations

import json
import time

import pytest

from tests.elastic.agents import SCRIPTS, Agents, torchrun_cmd
from tests.elastic.rdzv_util import job_id

pytestmark = [pytest.mark.etcd, pytest.mark.multirank, pytest.mark.timeout(120)]


def test_two_agents_run_a_gloo_job(etcd_server, tmp_path) -> None:
    run = job_id()
    agents = Agents(tmp_path)
    try:
        procs = [agents.start(torchrun_cmd(etcd_server.endpoint, run, "2", 1,
                                           SCRIPTS / "allreduce.py", [str(tmp_path)]), f"agent{i}")
                 for i in range(2)]
        deadline = time.monotonic() + 90
        for p in procs:
            p.wait(max(1, deadline - time.monotonic()))
        assert [p.returncode for p in procs] == [0, 0], agents.logs()
        seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
        assert {s["world"] for s in seen} == {2}
        assert {s["sum"] for s in seen} == {1.0 + 2}
        assert sorted(s["group_rank"] for s in seen) == [0, 1]
        assert len({s["master"] for s in seen}) == 1  # the round's one store
    finally:
        agents.close()
