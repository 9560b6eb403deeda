"""Warm worker starts: a per-node fork server that imports the workers' heavy modules
once and forks each worker from that state.

A restart after a fault is mostly a new Python process importing torch and the engine:
10-14 s of the ~20 s kill -> first step on a loaded 2-core node (docs/elastic.md),
the same in every restart. Here the node's server (`serve`) has imported them already;
each worker start is a small client (`run`, standard library only) that torchrun's agent
launches and monitors like any worker. The client hands its argv, environment, working
directory and stdio to the server over a UNIX socket; the server forks a child that
becomes the worker (`runpy`, as `python -m module` or `python script.py` would run it)
and reports its pid and, when it ends, its exit status, which the client exits with.

The agent does not wait for the server: it imports torch (which torchrun needs), forks
the server from that state (`WarmServer.start(fork=True)`: torch is not imported a
second time, a node's largest single import), and goes on to its rendezvous while the
server imports the rest (seconds on a loaded node, which a replacement would otherwise
add to its time to the first step). A client that comes first waits for the socket while the
server lives; if the server failed (its imports raised, or it died), the client starts
its worker cold instead (`exec` of the same command), so a broken server costs a warm
start, never the worker.

What the agent does to the client reaches the worker:
- SIGTERM, SIGINT, SIGHUP, SIGUSR1, SIGUSR2 are forwarded to the worker;
- SIGKILL of the client (torchrun's last resort, a chaos kill) closes the socket, and the
  worker kills itself on seeing that;
- SIGSTOP of the client does not stop the worker (it cannot be forwarded): a hang
  injected that way is not a hang here.

The server forks from a process that has imported torch but run nothing, which is what
torch's own fork-based DataLoader workers rely on. Modules that start threads or event
loops at import must not be preloaded (the child would lack those threads).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib
import json
import os
import runpy
import signal
import socket
import struct
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from relight.errors import RelightError

__all__ = ["DEFAULT_PRELOAD", "PARENT_ENV", "WarmServer", "client_command", "run", "serve",
           "worker_of"]

DEFAULT_PRELOAD = ("torch", "torch.distributed.tensor", "torch._dynamo", "relight.ckpt",
                   "relight.storage")
"""What a Relight worker imports (torch, DTensor, the checkpoint engine, storage), by
their installed names (a bare `ckpt` resolved only from inside a Relight checkout, and
failed the server, so every worker started cold, anywhere else); a caller adds its
training module. torch._dynamo is there because the first `DTensor.from_local` of a
process imports it (torch._compile's disable wrapper): 1.6 s on this 2-core machine
under load, paid inside every restarted worker's restore otherwise."""

PARENT_ENV = "RELIGHT_WARM_PARENT_PID"
"""Set in a warm-started worker's environment to the pid of the process that started its
client (torchrun's agent): the parent it would have had without the fork server."""

_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
_LEN = struct.Struct("!I")
_MAX_HEADER = 16 << 20


class WarmStartError(RelightError, RuntimeError):
    """The fork server could not be reached or did not start."""


# -- the server ---------------------------------------------------------------------------

def _failed_marker(socket_path: str) -> Path:
    return Path(socket_path).parent / "server.failed"


def _pid_file(socket_path: str) -> Path:
    return Path(socket_path).parent / "server.pid"


def serve(socket_path: str, preload: Sequence[str], *, warm_s3: bool = True) -> None:
    """Import `preload`, then fork a worker for every client on `socket_path` until
    SIGTERM. Never returns in a forked child. If an import fails, say so next to the
    socket (clients then start cold) and raise. `warm_s3`: with `relight.storage`
    preloaded, also do the S3 SDK's one-time set-up (off for a job whose checkpoints are
    not on S3: a second of a core its workers would never use)."""
    t0 = time.monotonic()
    inherited = sum(1 for name in preload if name in sys.modules)
    try:
        for name in preload:
            importlib.import_module(name)
        if warm_s3 and "relight.storage" in preload:
            # botocore's one-time client set-up, done here once instead of in every
            # worker's first S3 operation (no thread or connection outlives it: safe to
            # fork after).
            from relight.storage.settings import warm_s3_sdk

            warm_s3_sdk()
    except BaseException as exc:
        with contextlib.suppress(OSError):
            _failed_marker(socket_path).write_text(f"{type(exc).__name__}: {exc}\n")
        raise
    with contextlib.suppress(FileNotFoundError):
        os.unlink(socket_path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    os.chmod(socket_path, 0o600)  # only this user may start workers through it
    listener.listen(64)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    _exit_with_parent()
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} relight warm server ready on {socket_path} "
          f"({len(preload)} modules, {inherited} of them imported before it started; "
          f"{time.monotonic() - t0:.1f} s of imports)",
          file=sys.stderr, flush=True)
    try:
        while True:
            conn, _ = listener.accept()
            try:
                header, fds = _receive(conn)
            except (OSError, ValueError) as exc:
                print(f"relight warm server: bad request: {exc}", file=sys.stderr, flush=True)
                conn.close()
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                listener.close()
                _become_worker(conn, header, fds)  # never returns
            for fd in fds:
                os.close(fd)
            threading.Thread(target=_report, args=(conn, pid), daemon=True,
                             name=f"warm-reap-{pid}").start()
    finally:
        listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(socket_path)


def _exit_with_parent(interval_s: float = 0.5) -> None:
    """Stop the server (SIGTERM to itself) once the agent that started it is gone: an
    agent killed with SIGKILL (a lost node, a chaos kill) cannot stop it, and an orphaned
    server would hold its socket and memory forever. The watcher thread does not exist
    in forked workers (only the forking thread survives a fork)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, daemon=True, name="warm-parent-watch").start()


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    msg, fds, _, _ = socket.recv_fds(conn, _LEN.size, 3)
    if len(msg) < _LEN.size or len(fds) != 3:
        for fd in fds:
            os.close(fd)
        raise ValueError("expected a length prefix and three file descriptors")
    try:
        (n,) = _LEN.unpack(msg[:_LEN.size])
        if n > _MAX_HEADER:
            raise ValueError(f"header of {n} bytes")
        body = b""
        while len(body) < n:
            chunk = conn.recv(n - len(body))
            if not chunk:
                raise ValueError("client left before its header was complete")
            body += chunk
        return json.loads(body), fds
    except BaseException:
        for fd in fds:  # a refused request keeps none of the client's descriptors
            os.close(fd)
        raise


def _send(conn: socket.socket, obj: dict) -> None:
    with contextlib.suppress(OSError):
        conn.sendall((json.dumps(obj) + "\n").encode())


def _report(conn: socket.socket, pid: int) -> None:
    _send(conn, {"pid": pid})
    _, status = os.waitpid(pid, 0)
    _send(conn, {"exit": os.waitstatus_to_exitcode(status)})
    conn.close()


def _become_worker(conn: socket.socket, header: dict, fds: list[int]) -> None:
    code = 1
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        for sig in _FORWARDED:
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.chdir(header["cwd"])
        os.environ.clear()
        os.environ.update(header["env"])
        threading.Thread(target=_die_with_client, args=(conn,), daemon=True,
                         name="warm-client-watch").start()
        argv = list(header["argv"])
        _set_path_entry(argv, header["cwd"])
        try:
            if argv[0] == "-m":
                sys.argv = argv[1:]
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv = argv
                runpy.run_path(argv[0], run_name="__main__")
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if not isinstance(exc.code, int | None):
                print(exc.code, file=sys.stderr)
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001 - a worker's uncaught error: exit 1 as Python would
        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _set_path_entry(argv: Sequence[str], cwd: str) -> None:
    """Put first on sys.path what `python` would have put there for `argv`: the script's
    own folder (`script.py ...`, symbolic links resolved) or the working directory (`-m
    module ...`). The server's own first entry (its agent's) is replaced: without this a
    script that imports a module beside it runs cold and fails warm. With `-P` (or
    PYTHONSAFEPATH) Python puts nothing there, and neither does this."""
    if sys.flags.safe_path:
        return
    entry = cwd if argv[0] == "-m" else os.path.dirname(
        os.path.realpath(os.path.join(cwd, argv[0])))
    if sys.path:
        sys.path[0] = entry
    else:
        sys.path.insert(0, entry)


def _die_with_client(conn: socket.socket) -> None:
    """The client sends nothing after its header: EOF means it is gone (SIGKILLed), and
    the worker must not outlive it."""
    with contextlib.suppress(OSError):
        while conn.recv(1):
            pass
    os.kill(os.getpid(), signal.SIGKILL)


# -- the client ---------------------------------------------------------------------------

def _server_failed(socket_path: str) -> str | None:
    """Why the server that `socket_path` belongs to can no longer serve (its imports
    failed, or its process is gone), or None while it may still come up."""
    marker = _failed_marker(socket_path)
    if marker.exists():
        return f"its imports failed: {marker.read_text(errors='replace').strip()}"
    try:
        pid = int(_pid_file(socket_path).read_text())
    except (OSError, ValueError):
        return None  # not started by a WarmServer here: only the timeout applies
    try:
        # The server is the agent's child: once dead it is a zombie until reaped.
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        state = "" if _pid_alive(pid) else "X"
    return f"its process {pid} is gone" if state in ("Z", "X") else None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process of that pid
    return True


def _start_cold(argv: Sequence[str], why: str) -> None:
    """Become the worker: exec `python argv` in this process (never returns)."""
    print(f"relight warm start: the warm server cannot start this worker ({why}); "
          "starting it cold", file=sys.stderr, flush=True)
    os.execv(sys.executable, [sys.executable, *argv])


def run(socket_path: str, argv: Sequence[str], connect_timeout_s: float = 300.0) -> int:
    """Start `argv` (`-m module ...` or `script.py ...`) in a worker forked by the server
    at `socket_path`, with this process's environment, directory and stdio; forward
    signals to it; return its exit status (128 + n if signal n ended it). Waits up to
    `connect_timeout_s` for a server still importing; a server that failed makes this
    process the worker, started cold."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    deadline = time.monotonic() + connect_timeout_s
    while True:
        try:
            conn.connect(socket_path)
            break
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            why = _server_failed(socket_path)
            if why is not None:
                conn.close()
                _start_cold(argv, why)
            if time.monotonic() > deadline:
                raise WarmStartError(f"no warm server on {socket_path} after "
                                     f"{connect_timeout_s:.0f} s: {exc}") from exc
            time.sleep(0.05)
    # The worker's parent is the server, not the agent that started this client: tell
    # it who that was (a worker that reports its supervisor reads this).
    env = {**os.environ, PARENT_ENV: str(os.getppid())}
    body = json.dumps({"argv": list(argv), "env": env,
                       "cwd": os.getcwd()}).encode()
    socket.send_fds(conn, [_LEN.pack(len(body))], [0, 1, 2])
    conn.sendall(body)
    reader = conn.makefile("rb")
    first = reader.readline()
    if not first:
        raise WarmStartError(f"the warm server on {socket_path} refused the start")
    pid = json.loads(first)["pid"]
    _record_worker(socket_path, pid)

    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)

    for sig in _FORWARDED:
        signal.signal(sig, forward)
    last = reader.readline()
    if not last:  # the server died: the worker's watcher saw nothing; kill it ourselves
        forward(signal.SIGKILL, None)
        return 1
    code = json.loads(last)["exit"]
    return 128 - code if code < 0 else code


def _workers_dir(socket_path: str) -> Path:
    return Path(socket_path).parent / "workers"


def _record_worker(socket_path: str, pid: int) -> None:
    """Leave `{socket dir}/workers/{client pid}` holding the worker's pid, so a tool
    that sees only the agent's process tree (the chaos harness freezing a worker with
    SIGSTOP, which a client cannot forward) can find the worker behind a client."""
    d = _workers_dir(socket_path)
    try:
        d.mkdir(exist_ok=True)
        tmp = d / f".{os.getpid()}.tmp"
        tmp.write_text(str(pid))
        os.replace(tmp, d / str(os.getpid()))
    except OSError:
        pass  # only observability: the worker runs either way


def worker_of(client_cmdline: Sequence[str], client_pid: int) -> int | None:
    """The pid of the worker a warm client (`client_command`) started, from the client's
    command line and pid; None if `client_cmdline` is not a warm client or its worker is
    not known (yet)."""
    argv = list(client_cmdline)
    if "relight.elastic.warm" not in argv or "run" not in argv or "--socket" not in argv:
        return None
    socket_path = argv[argv.index("--socket") + 1]
    try:
        return int((_workers_dir(socket_path) / str(client_pid)).read_text())
    except (OSError, ValueError):
        return None


def client_command(socket_path: str, argv: Sequence[str]) -> list[str]:
    """The command that starts `argv` through the server (what the agent launches)."""
    return [sys.executable, "-m", "relight.elastic.warm", "run", "--socket", socket_path, "--",
            *argv]


class WarmServer:
    """The fork server as a child process of the caller (one per node)."""

    def __init__(self, socket_path: str | os.PathLike[str], preload: Sequence[str],
                 log_path: str | os.PathLike[str] | None = None,
                 env: dict[str, str] | None = None, warm_s3: bool = True) -> None:
        if len(os.fsencode(socket_path)) > 100:  # sun_path holds 108 bytes
            raise WarmStartError(f"socket path {socket_path} is too long for AF_UNIX")
        self.socket_path = str(socket_path)
        self.preload = list(preload)
        self.log_path = log_path
        self.env = env
        self.warm_s3 = warm_s3
        self._proc: Any = None

    def start(self, timeout_s: float = 300.0, *, wait: bool = True,
              fork: bool = False) -> WarmServer:
        """Start the server; with `wait`, return once it serves (its imports done), else
        at once (clients wait for it, and start cold if it fails). With `fork`, the
        server is a fork of this process rather than a new interpreter: what this process
        has imported (an agent's torch) is not imported a second time, which on a node
        whose cores are busy is seconds off the first worker's start. Only while this
        process runs no other Python thread (one could hold the import lock across the
        fork); otherwise, and with `env` given, a new interpreter as without `fork`."""
        import subprocess

        Path(self.socket_path).parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            _failed_marker(self.socket_path).unlink()
        if fork and self.env is None and threading.active_count() == 1:
            self._proc = _fork_server(self.socket_path, self.preload, self.log_path,
                                      self.warm_s3)
        else:
            log = (open(self.log_path, "ab") if self.log_path  # noqa: SIM115
                   else subprocess.DEVNULL)
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "relight.elastic.warm", "serve", "--socket",
                 self.socket_path, "--preload", ",".join(self.preload),
                 *([] if self.warm_s3 else ["--no-s3-sdk"])],
                stdout=log, stderr=subprocess.STDOUT if self.log_path else None,
                start_new_session=True, env=self.env)
            if log is not subprocess.DEVNULL:
                log.close()
        pid_file = _pid_file(self.socket_path)
        tmp = pid_file.with_name(f".{pid_file.name}.tmp")
        tmp.write_text(str(self._proc.pid))
        os.replace(tmp, pid_file)
        if not wait:
            return self
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(self.socket_path):
            if self._proc.poll() is not None:
                raise WarmStartError(f"the warm server exited with {self._proc.returncode} "
                                     f"while importing {self.preload} (log {self.log_path})")
            if time.monotonic() > deadline:
                self.stop()
                raise WarmStartError(f"the warm server was not ready in {timeout_s:.0f} s")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except Exception:  # noqa: BLE001
                self._proc.kill()
                self._proc.wait()
        self._proc = None


class _ForkedServer:
    """A server forked by `_fork_server`, with the part of `subprocess.Popen`'s interface
    `WarmServer` uses."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere
                self.returncode = -1
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"warm server {self.pid} still running after {timeout} s")
            time.sleep(0.02)
        assert self.returncode is not None
        return self.returncode

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def _signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)


def _fork_server(socket_path: str, preload: Sequence[str],
                 log_path: str | os.PathLike[str] | None, warm_s3: bool) -> _ForkedServer:
    """Fork this process into a server (`serve`) in a session of its own, its stdout and
    stderr on `log_path`; the child never returns into the caller's code."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return _ForkedServer(pid)
    code = 1
    try:
        os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        if log_path is not None:
            out = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(out, 1)
            os.dup2(out, 2)
            os.close(out)
        for sig in (signal.SIGQUIT, *_FORWARDED):
            signal.signal(sig, signal.SIG_DFL)
        serve(socket_path, preload, warm_s3=warm_s3)
        code = 0
    except SystemExit as exc:  # serve's SIGTERM handler
        code = exc.code if isinstance(exc.code, int) else 0
    except BaseException:  # noqa: BLE001 - the import error, in the server's log
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m relight.elastic.warm", description=__doc__.split(
        "\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="import the modules, then fork workers on request")
    s.add_argument("--socket", required=True)
    s.add_argument("--preload", default="torch", help="comma-separated modules")
    s.add_argument("--no-s3-sdk", action="store_true",
                   help="skip the S3 SDK's set-up (the job's checkpoints are not on S3)")
    r = sub.add_parser("run", help="start a worker through the server")
    r.add_argument("--socket", required=True)
    r.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    if args.cmd == "serve":
        serve(args.socket, [m for m in args.preload.split(",") if m],
              warm_s3=not args.no_s3_sdk)
        return 0
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("run needs a command after --: -m module ... or script.py ...")
    try:
        return run(args.socket, command)
    except WarmStartError as exc:
        print(f"relight warm start: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
