"""`elastic.warm`: a real fork server (torch preloaded) and real clients: exit statuses,
stdio, environment, signal forwarding, and no worker outliving a SIGKILLed client."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from relight.elastic.warm import WarmServer, client_command

ROOT = Path(__file__).resolve().parents[2]
WORKER = str(Path(__file__).parent / "scripts" / "warm_worker.py")

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> WarmServer:
    d = tmp_path_factory.mktemp("warm")
    srv = WarmServer(d / "s.sock", ["torch"], log_path=d / "server.log").start()
    yield srv
    srv.stop()
    assert not os.path.exists(srv.socket_path)


def _start(server: WarmServer, tmp_path: Path, mode: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WARM_TEST": mode}
    return subprocess.Popen(client_command(server.socket_path, [WORKER, str(tmp_path / "o"),
                                                                mode]),
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _records(tmp_path: Path, n: int = 1, timeout: float = 60) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        path = tmp_path / "o"
        if path.exists():
            lines = path.read_text().splitlines()
            if len(lines) >= n:
                return [json.loads(line) for line in lines]
        time.sleep(0.05)
    raise AssertionError("the worker never reported")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("mode,status", [("exit0", 0), ("exit3", 3), ("raise", 1)])
def test_exit_status_stdio_env_cwd(server, tmp_path, mode, status) -> None:
    client = _start(server, tmp_path, mode)
    out, err = client.communicate(timeout=60)
    assert client.returncode == status
    (rec,) = _records(tmp_path)
    assert rec["torch_preloaded"] and rec["pid"] != client.pid
    assert rec["env"] == mode and rec["cwd"] == str(tmp_path)
    assert rec["argv"] == [WORKER, str(tmp_path / "o"), mode]
    assert f"worker says hi on stdout ({mode})" in out
    assert ("RuntimeError: worker failed" in err) == (mode == "raise")


# A script that imports a module beside it, as a user's training script does: run warm,
# it must find it as `python train.py` would, from whatever directory it is started in.
BESIDE = """
import json, sys
import helper_beside
with open(sys.argv[1], "a") as f:
    f.write(json.dumps({"path0": sys.path[0], "helper": helper_beside.NAME}) + "\\n")
"""


def test_a_script_imports_the_modules_beside_it(server, tmp_path) -> None:
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir()
    elsewhere.mkdir()
    (project / "train.py").write_text(BESIDE)
    (project / "helper_beside.py").write_text("NAME = 'beside'\n")
    for argv, cwd, entry in (([str(project / "train.py")], elsewhere, project),
                             (["../project/train.py"], elsewhere, project),
                             (["-m", "train"], project, project)):
        out = tmp_path / "o"
        out.unlink(missing_ok=True)
        client = subprocess.run(client_command(server.socket_path, [*argv, str(out)]),
                                cwd=cwd, env={**os.environ, "PYTHONPATH": str(ROOT)},
                                capture_output=True, text=True, timeout=60)
        assert client.returncode == 0, (argv, client.stderr)
        (rec,) = _records(tmp_path)
        assert rec == {"path0": str(entry.resolve()), "helper": "beside"}, argv


def test_sigterm_is_forwarded(server, tmp_path) -> None:
    client = _start(server, tmp_path, "wait")
    (rec,) = _records(tmp_path)
    client.send_signal(signal.SIGTERM)
    assert client.wait(60) == 77  # the worker's own SIGTERM handler ran
    assert not _alive(rec["pid"])


def test_sigkilled_client_takes_its_worker_along(server, tmp_path) -> None:
    client = _start(server, tmp_path, "wait")
    (rec,) = _records(tmp_path)
    client.kill()
    client.wait(10)
    deadline = time.monotonic() + 30
    while _alive(rec["pid"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(rec["pid"])


def test_no_server_is_a_clear_error(tmp_path) -> None:
    res = subprocess.run([sys.executable, "-c", (
        "import sys; from relight.elastic.warm import run; "
        f"sys.exit(run({str(tmp_path / 'none.sock')!r}, ['-m', 'json'], 0.5))")],
        env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        timeout=60)
    assert res.returncode != 0 and "no warm server" in res.stderr


def _kill_agent_then_server_gone(agent: subprocess.Popen, server_pid: int) -> None:
    agent.kill()
    agent.wait(10)
    deadline = time.monotonic() + 30  # the server polls its parent every 0.5 s
    while _alive(server_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(server_pid), "the warm server outlived its agent"


def test_server_exits_when_its_agent_is_killed(tmp_path) -> None:
    """An agent killed with SIGKILL cannot stop its server; the server must not outlive
    it (an orphan would keep its socket, its memory and its imports forever)."""
    code = ("import sys, time; from relight.elastic.warm import WarmServer; "
            "s = WarmServer(sys.argv[1], ['json']).start(); print(s._proc.pid, flush=True); "
            "time.sleep(600)")
    agent = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "s.sock")],
                             env={**os.environ, "PYTHONPATH": str(ROOT)},
                             stdout=subprocess.PIPE, text=True)
    try:
        server_pid = int(agent.stdout.readline())
        assert _alive(server_pid)
        _kill_agent_then_server_gone(agent, server_pid)
        assert not (tmp_path / "s.sock").exists()
    finally:
        if agent.poll() is None:
            agent.kill()


def test_a_server_forked_from_its_agent_does_not_import_twice(tmp_path) -> None:
    """`start(fork=True)`, as `relight run` starts it once it has imported torch: the
    server is a fork of the agent (no second interpreter), the modules the agent had
    imported are not imported again, its workers run, and it leaves with its agent.
    (`decimal` stands for torch here: the same path, a fraction of the import time.)"""
    code = ("import sys, time, decimal; from relight.elastic.warm import WarmServer; "
            "s = WarmServer(sys.argv[1], ['decimal', 'fractions'], log_path=sys.argv[2])"
            ".start(fork=True); print(s._proc.pid, flush=True); time.sleep(600)")
    agent = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "s.sock"),
                              str(tmp_path / "server.log")],
                             env={**os.environ, "PYTHONPATH": str(ROOT)},
                             stdout=subprocess.PIPE, text=True)
    try:
        server_pid = int(agent.stdout.readline())
        cmdline = Path(f"/proc/{server_pid}/cmdline").read_bytes()
        assert cmdline == Path(f"/proc/{agent.pid}/cmdline").read_bytes(), cmdline
        deadline = time.monotonic() + 30  # the ready line follows the socket's creation
        while "ready on" not in (log := (tmp_path / "server.log").read_text()):
            assert time.monotonic() < deadline, log
            time.sleep(0.05)
        assert "2 modules, 1 of them imported before it started" in log, log
        srv = WarmServer(tmp_path / "s.sock", [])
        client = _start(srv, tmp_path, "exit0")
        out, err = client.communicate(timeout=60)
        assert client.returncode == 0, err
        (rec,) = _records(tmp_path)
        assert rec["ppid"] == server_pid and rec["pid"] != client.pid
        _kill_agent_then_server_gone(agent, server_pid)
    finally:
        if agent.poll() is None:
            agent.kill()


def test_a_server_that_fails_to_import_starts_its_workers_cold(tmp_path) -> None:
    """The agent does not wait for its server; if the server's imports fail, a client
    already waiting becomes the worker itself instead of failing it."""
    srv = WarmServer(tmp_path / "s.sock", ["relight_no_such_module"],
                     log_path=tmp_path / "server.log").start(wait=False)
    try:
        client = _start(srv, tmp_path, "exit3")
        out, err = client.communicate(timeout=120)
        assert client.returncode == 3, err
        (rec,) = _records(tmp_path)
        assert rec["pid"] == client.pid, "the worker was not the client process itself"
        assert not rec["torch_preloaded"]
        assert "starting it cold" in err and "relight_no_such_module" in err
        assert "worker says hi on stdout (exit3)" in out
    finally:
        srv.stop()


@pytest.mark.long  # `relight run`'s warm-start test takes this path in the default tier
def test_a_client_waits_for_a_server_still_importing(tmp_path) -> None:
    srv = WarmServer(tmp_path / "s.sock", ["torch"],
                     log_path=tmp_path / "server.log").start(wait=False)
    try:
        client = _start(srv, tmp_path, "exit0")  # before the socket exists
        out, err = client.communicate(timeout=120)
        assert client.returncode == 0, err
        (rec,) = _records(tmp_path)
        assert rec["torch_preloaded"] and rec["pid"] != client.pid
        assert "starting it cold" not in err
    finally:
        srv.stop()
