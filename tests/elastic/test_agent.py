"""The node agent under `relight run`: shutdown timeout vs the preemption grace, the
lease revoked on SIGTERM, exit status 76 and max-restarts, the agent's metrics."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

from relight.elastic.agent_metrics import AgentMetrics, AgentMetricsConfig
from relight.elastic.etcd_client import EtcdClient, EtcdSettings
from relight.elastic.etcd_server import free_port
from relight.elastic.launch import (
    DEFAULT_PREEMPTION_GRACE_S,
    SHUTDOWN_MARGIN_S,
    main,
    needs_s3_sdk,
    shutdown_timeout_s,
)
from relight.elastic.rendezvous import _notify, record_event
from relight.runtime.config import PreemptionConfig
from relight.runtime.launch_hints import training_hints
from tests.elastic.agents import RDZV_CONF, ROOT, SCRIPTS, Agents, events, wait_for
from tests.elastic.rdzv_util import job_id
from tests.elastic.test_launch import etcd_processes_in

DEFAULT_GRACE = PreemptionConfig().grace_s


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def test_shutdown_timeout_covers_the_preemption_grace(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    assert shutdown_timeout_s(None, None) == 30  # torchrun's default, nothing to cover
    assert shutdown_timeout_s(None, 30.0) == 30 + SHUTDOWN_MARGIN_S
    assert shutdown_timeout_s(None, 90.5) == 91 + SHUTDOWN_MARGIN_S
    assert shutdown_timeout_s(300, 90.0) == 300  # a longer one asked for is kept
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "120")
    assert shutdown_timeout_s(None, 30.0) == 120

    cfg = tmp_path / "train.toml"
    cfg.write_text('[preemption]\ngrace_s = 75.0\n[checkpoint]\nurl = "s3://b/run"\n')
    runtime_train = ["--module", "relight.runtime.train", "--config", str(cfg)]
    hints = training_hints(runtime_train)
    assert (hints.preemption_grace_s, hints.ckpt_url) == (75.0, "s3://b/run")
    # Overrides on the training command line count, as the trainer applies them.
    assert training_hints([*runtime_train, "--preemption.grace_s=12"]).preemption_grace_s == 12.0
    assert training_hints([*runtime_train, "--preemption.enabled=false"]).preemption_grace_s is None
    assert training_hints(["--no-python", "/venv/bin/relight", "train", "--config",
                           str(cfg)]).preemption_grace_s == 75.0
    # Another command: the launcher's default grace, which is the runtime's default too.
    assert training_hints(["train.py"]) is None
    assert DEFAULT_PREEMPTION_GRACE_S == DEFAULT_GRACE
    # The warm server sets the S3 SDK up only where a worker may use it.
    assert needs_s3_sdk(hints.ckpt_url) and needs_s3_sdk(None)
    assert not needs_s3_sdk(training_hints([*runtime_train, "--checkpoint.url=/tmp/ck"]).ckpt_url)


@pytest.mark.etcd
@pytest.mark.multirank
@pytest.mark.timeout(150)
def test_sigterm_revokes_the_lease_after_the_workers_saved(etcd_server, tmp_path) -> None:
    """Two `relight run` nodes, a 30 s lease TTL. SIGTERM to one: its workers get their
    grace (they save and exit 76), its node key goes at once (not after 30 s), and the
    other node re-forms alone, its workers told the new round; its metrics show it."""
    out = tmp_path / "out"
    out.mkdir()
    run = job_id()
    conf = ",".join(f"{k}={v}" for k, v in {**RDZV_CONF, "lease_ttl": "30",
                                              "last_call_timeout": "5",
                                              "rejoin_timeout": "5"}.items())
    ports = []
    agents = Agents(out)
    procs = []
    try:
        for i in range(2):
            ports.append(free_port())
            cmd = [sys.executable, "-m", "relight.elastic.launch",
                   f"--rdzv-endpoint={etcd_server.endpoint}", f"--rdzv-id={run}",
                   "--nnodes=1:2", "--nproc-per-node=1", "--monitor-interval=0.1",
                   f"--rdzv-conf={conf}", "--preemption-grace-s=2",
                   f"--metrics-port={ports[i]}", "--run-dir", str(tmp_path / f"run{i}"), "--",
                   sys.executable, str(SCRIPTS / "sleeper.py"), "--out", str(out),
                   "--save-s", "1.5"]
            procs.append(agents.start(cmd, f"node{i}"))
        client = EtcdClient(EtcdSettings(endpoints=(etcd_server.endpoint,)))
        nodes_prefix = f"{RDZV_CONF['prefix']}/{run}/nodes/"
        pair = wait_for(lambda: (lambda w: w if len(w) == 2 else None)(
            [e for e in events(out) if e["ev"] == "start" and e["world"] == 2]),
            90, "both workers up", agents)
        assert len(client.get_prefix(nodes_prefix)[0]) == 2
        # Usually round 0; round 1 if one node was alone past the last call.
        (r0,) = {int(e["round"]) for e in pair}
        before = scrape(ports[1])
        assert before["relight_rendezvous_round"] == r0 and before["relight_nodes"] == 2

        victim, survivor = procs
        t_term = time.monotonic()
        t_term_wall = time.time()
        victim.send_signal(signal.SIGTERM)
        victim.wait(30)
        gone_after = time.monotonic() - t_term
        assert victim.returncode == 128 + signal.SIGTERM, agents.logs()
        # Its worker had its grace: it saved, then exited 76.
        victim_worker = next(e["pid"] for e in pair if e["agent_pid"] == victim.pid)
        assert (out / f"saved-{victim_worker}").exists(), agents.logs()
        # The node key left with the agent, not one 30 s TTL later.
        keys = [kv.key for kv in client.get_prefix(nodes_prefix)[0]]
        assert len(keys) == 1 and gone_after < 15, (keys, gone_after)
        # The survivor re-forms alone in the next round; its new worker is told the round.
        new = wait_for(lambda: [e for e in events(out) if e["ev"] == "start"
                                and e["t"] > t_term_wall], 60, "the survivor's new worker",
                       agents)
        assert [(e["round"], e["world"], e["agent_pid"]) for e in new] == [
            (str(r0 + 1), 1, survivor.pid)]
        m = wait_for(lambda: (lambda s: s if s["relight_rendezvous_round"] == r0 + 1 else None)(
            scrape(ports[1])), 10, "survivor metrics at the next round")
        assert m["relight_world_size"] == 1 and m["relight_nodes"] == 1
        assert m["relight_restarts"] == before["relight_restarts"] + 1
        membership = 'relight_worker_group_restarts_total{reason="membership"}'
        assert m[membership] == before.get(membership, 0) + 1
        log = (out / "node1.log").read_text()
        assert f"round={r0}] fault detected: participants" in log, log[-3000:]
        assert f"round={r0 + 1}] joined as rank 0 of 1" in log, log[-3000:]
    finally:
        agents.close()


_EXITING_NODE = """
import sys
from tests.elastic.rdzv_util import handler
h = handler(sys.argv[1], sys.argv[2], 1, 1, lease_ttl="30")
h.next_rendezvous()
print(h.node_id, flush=True)
# exits without shutdown(), as plain torchrun's agent does when a signal stops it
"""


@pytest.mark.etcd
def test_lease_revoked_at_exit_without_shutdown(etcd_server) -> None:
    run = job_id()
    res = subprocess.run([sys.executable, "-c", _EXITING_NODE, etcd_server.endpoint, run],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    node = res.stdout.strip()
    client = EtcdClient(EtcdSettings(endpoints=(etcd_server.endpoint,)))
    # Gone as the process exited, not 30 s later; the rendezvous was not closed.
    assert client.get(f"{RDZV_CONF['prefix']}/{run}/nodes/{node}") is None
    assert "leaving (process exit)" in res.stderr
    assert not client.get(f"{RDZV_CONF['prefix']}/{run}/state").json()["closed"]


def test_agent_metrics_from_events_and_checkpoints(tmp_path) -> None:
    from relight import ckpt

    url = str(tmp_path / "ckpt")
    metrics = AgentMetrics(AgentMetricsConfig(port=0, nproc_per_node=4, ckpt_url=url,
                                              ckpt_poll_s=0.1))
    port = metrics.start()
    try:
        m = scrape(port)
        assert m["relight_restarts"] == 0
        assert m["relight_last_committed_step"] != m["relight_last_committed_step"]  # NaN
        record_event("rdzv_done", run_id="j", node="n", round=0, rank=0, world=2,
                     reason="start")
        record_event("rdzv_done", run_id="j", node="n", round=3, rank=1, world=3,
                     reason="fault")
        _notify("nodes_waiting", {"run_id": "j", "node": "n", "round": 3, "waiting": 2})
        mgr = ckpt.CheckpointManager(url, keep_last=2)
        mgr.save(7, {"w": torch.ones(4)}, async_save=False)
        m = wait_for(lambda: (lambda s: s if s["relight_last_committed_step"] == 7 else None)(
            scrape(port)), 10, "the committed step in the metrics")
        assert (m["relight_rendezvous_round"], m["relight_world_size"], m["relight_nodes"],
                m["relight_nodes_waiting"], m["relight_restarts"]) == (3, 12, 3, 2, 1)
        assert m['relight_worker_group_restarts_total{reason="fault"}'] == 1
        assert 0 <= m["relight_last_commit_age_seconds"] < 60
    finally:
        metrics.close()
    # Closed: no longer subscribed (an event now must not touch it).
    record_event("rdzv_done", run_id="j", node="n", round=9, rank=0, world=1, reason="fault")
    assert metrics.round._value.get() == 3


def test_metrics_port_in_use_is_a_clear_error(tmp_path, capsys) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        sigterm_before = signal.getsignal(signal.SIGTERM)
        events_before = os.environ.get("RELIGHT_EVENTS_FILE")
        handlers_before = list(logging.getLogger("relight.elastic").handlers)
        rc = main([f"--metrics-port={port}", "--run-dir", str(tmp_path / "run"), "--", "true"])
    assert rc == 1
    assert f"127.0.0.1:{port}" in capsys.readouterr().err
    assert etcd_processes_in(tmp_path / "run") == []  # the embedded etcd was stopped
    # Called in-process, main() leaves the process as it found it.
    assert os.environ.get("RELIGHT_EVENTS_FILE") == events_before
    assert signal.getsignal(signal.SIGTERM) is sigterm_before
    assert logging.getLogger("relight.elastic").handlers == handlers_before
