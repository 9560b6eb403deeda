"""Running torchrun agents as separate processes for the tests, and cleaning up after them.

Each agent starts in its own session; its workers start in sessions of their own
(torchrun does that), so killing a "node" means the agent and every worker it
started. Worker pids come from the events the test scripts write.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"

RDZV_CONF = {
    "prefix": "/relight-test",
    "lease_ttl": "2",
    "last_call_timeout": "1",
    "rejoin_timeout": "10",
    "join_timeout": "60",
    "etcd_timeout": "10",
    "store_timeout": "30",
    "poll_interval": "0.2",
}


def torchrun_cmd(endpoint: str, run_id: str, nnodes: str, nproc: int, script: Path,
                 script_args: Sequence[str], max_restarts: int = 0,
                 conf: dict[str, str] | None = None, launcher: str = "torchrun",
                 ) -> list[str]:
    """One agent: plain torchrun (`launcher="torchrun"`) or `relight run` ("relight":
    Relight's agent, warm starts) on the relight-etcd rendezvous."""
    rdzv_conf = ",".join(f"{k}={v}" for k, v in {**RDZV_CONF, **(conf or {})}.items())
    if launcher == "relight":
        head = [sys.executable, "-c",
                "import sys; from relight.cli import main; sys.exit(main(['run', *sys.argv[1:]]))"]
        tail = ["--", sys.executable, str(script), *script_args]
    else:
        head = [sys.executable, "-m", "torch.distributed.run"]
        tail = [str(script), *script_args]
    return [*head, "--rdzv-backend=relight-etcd",
            f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}", f"--nnodes={nnodes}",
            f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
            "--monitor-interval=0.1", f"--rdzv-conf={rdzv_conf}", *tail]


class Agents:
    """Started torchrun agents; `close()` kills every agent and worker still alive."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.procs: list[subprocess.Popen] = []

    def start(self, cmd: list[str], name: str, env: dict[str, str] | None = None,
              ) -> subprocess.Popen:
        full_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
                    "RELIGHT_EVENTS_FILE": str(self.out / "events.jsonl"), **(env or {})}
        log = open(self.out / f"{name}.log", "wb")  # noqa: SIM115 - the child owns it
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env,
                                cwd=ROOT, start_new_session=True)
        log.close()
        self.procs.append(proc)
        return proc

    def worker_pids(self, agent: subprocess.Popen) -> set[int]:
        return {e["pid"] for e in events(self.out) if e.get("agent_pid") == agent.pid}

    def kill_node(self, agent: subprocess.Popen) -> None:
        """SIGKILL an agent and all its workers, as a machine loss would."""
        for pid in self.worker_pids(agent) | {agent.pid}:
            _kill(pid)
        agent.wait(10)

    def close(self) -> None:
        for proc in self.procs:
            for pid in self.worker_pids(proc):
                _kill(pid)
            if proc.poll() is None:
                _kill(proc.pid)
                proc.wait(10)

    def logs(self) -> str:
        text = []
        for log in sorted(self.out.glob("*.log")):
            text.append(f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}")
        return "\n".join(text)


def _kill(pid: int) -> None:
    for fn in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
        try:
            fn()
        except (ProcessLookupError, PermissionError):
            pass


def kill_sessions(procs: Iterable[subprocess.Popen]) -> None:
    """SIGKILL the session of every child still running (each started with
    `start_new_session=True`, so its own children go too) and reap it."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)


def events(out: Path) -> list[dict[str, Any]]:
    path = out / "events.jsonl"
    if not path.exists():
        return []
    result = []
    for line in path.read_text().splitlines():
        try:
            result.append(json.loads(line))
        except ValueError:
            pass  # a line being written right now
    return result


def wait_for(pred: Callable[[], Any], timeout: float, what: str, agents: Agents | None = None,
             interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}\n"
                                 + (agents.logs() if agents else ""))
        time.sleep(interval)
