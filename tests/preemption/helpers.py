"""Real training processes for the preemption tests: started in their own session, found
by their torchrun environment, always killed (whole process group) when a test ends."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[2]

# configs/tiny.toml made smaller still: ~0.1 s per step on 2 ranks, 2 cores.
TINY = [
    "--config", str(ROOT / "configs/tiny.toml"),
    "--model.n_layers=2", "--data.global_batch_size=8", "--data.micro_batch_size=4",
    "--train.log_every=1", "--train.watchdog_timeout_s=90", "--train.collective_timeout_s=60",
]


def env(**extra: str) -> dict[str, str]:
    out = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    out.update(extra)
    return out


class Job:
    """One command (a single trainer or a torchrun agent with its workers) in its own
    session; output to `log`. `close()` SIGKILLs the whole group."""

    def __init__(self, argv: list[str], log: Path, environ: dict[str, str] | None = None) -> None:
        self.log = log
        self._fh = open(log, "wb")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=environ or env(), stdout=self._fh,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"job did not exit within {timeout} s; log tail:\n"
                                 f"{self.text()[-3000:]}") from None

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def workers(self) -> dict[int, psutil.Process]:
        """torchrun workers by RANK (processes whose environment has LOCAL_RANK)."""
        out = {}
        try:
            procs = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return out
        for p in procs:
            try:
                e = p.environ()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            if "LOCAL_RANK" in e and p.status() != psutil.STATUS_ZOMBIE:
                out[int(e["RANK"])] = p
        return out

    def close(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=10)
        finally:
            self._fh.close()


@contextmanager
def job(argv: list[str], log: Path, environ: dict[str, str] | None = None) -> Iterator[Job]:
    j = Job(argv, log, environ)
    try:
        yield j
    finally:
        j.close()


def torchrun(nproc: int, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", "--max-restarts=0", "--monitor-interval=0.1",
            "-m", "relight.runtime.train", *args]


def single(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "relight.runtime.train", *args]


def metrics(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line being written
    return out


def wait_until(cond: Callable[[], bool], timeout: float, what: str, j: Job | None = None,
               poll: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if j is not None and j.proc.poll() is not None:
            raise AssertionError(f"job exited ({j.proc.returncode}) before {what}; log tail:\n"
                                 f"{j.text()[-3000:]}")
        if time.monotonic() > deadline:
            tail = j.text()[-3000:] if j is not None else ""
            raise AssertionError(f"timed out after {timeout} s waiting for {what}\n{tail}")
        time.sleep(poll)


def latest_step(url: str) -> int | None:
    from relight import ckpt

    return ckpt.CheckpointManager(url, keep_last=None).latest_step()


def read_state(url: str, step: int) -> dict[str, Any]:
    """Committed checkpoint `step` under manager root `url`, every tensor read whole."""
    from relight import ckpt
    from relight.ckpt.export import read_all

    return read_all(ckpt.CheckpointManager(url, keep_last=None).url_of(step))


def _lower(headers: object) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items()}  # type: ignore[attr-defined]


class FakeMetadata:
    """AWS IMDSv2 and GCP metadata on 127.0.0.1: no notice until `announce()`."""

    def __init__(self) -> None:
        self.announce_at: str | None = None
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self.token = "tok-123"
        meta = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _send(self, code: int, body: bytes = b"") -> None:
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_PUT(self) -> None:  # noqa: N802 - http.server's naming
                meta.requests.append(("PUT", self.path, _lower(self.headers)))
                if self.path == "/latest/api/token" and self.headers.get(
                        "X-aws-ec2-metadata-token-ttl-seconds"):
                    self._send(200, meta.token.encode())
                else:
                    self._send(400)

            def do_GET(self) -> None:  # noqa: N802
                meta.requests.append(("GET", self.path, _lower(self.headers)))
                if self.path == "/latest/meta-data/spot/instance-action":
                    if self.headers.get("X-aws-ec2-metadata-token") != meta.token:
                        self._send(401)
                    elif meta.announce_at is None:
                        self._send(404)
                    else:
                        self._send(200, json.dumps(
                            {"action": "terminate", "time": meta.announce_at}).encode())
                elif self.path == "/computeMetadata/v1/instance/preempted":
                    if self.headers.get("Metadata-Flavor") != "Google":
                        self._send(403)
                    else:
                        self._send(200, b"TRUE" if meta.announce_at else b"FALSE")
                else:
                    self._send(404)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def announce(self, in_s: float = 120.0) -> datetime:
        when = (datetime.now(UTC) + timedelta(seconds=in_s)).replace(microsecond=0)
        self.announce_at = when.strftime("%Y-%m-%dT%H:%M:%SZ")
        return when

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
