"""`relight`: one command for training, launching, checkpoints, chaos and benchmarks.

Each subcommand lives with the package that owns it and exposes `main(argv) -> int`;
this module sits above every package and only dispatches. Each command imports its
module when it runs, so `relight --help` is fast.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

__all__ = ["main", "SUBCOMMANDS"]


def _train(argv: list[str]) -> int:
    from relight.runtime.train import main as train_main
    return train_main(argv)


def _run(argv: list[str]) -> int:
    from relight.elastic.launch import main as launch_main
    from relight.runtime.launch_hints import training_hints
    return launch_main(argv, read_hints=training_hints)


def _data(argv: list[str]) -> int:
    from relight.runtime.prepare import main as prepare_main
    return prepare_main(argv)


def _ckpt(argv: list[str]) -> int:
    from relight.ckpt.cli import main as ckpt_main
    return ckpt_main(argv)


def _chaos(argv: list[str]) -> int:
    from relight.chaos.cli import main as chaos_main
    return chaos_main(argv)


def _bench(argv: list[str]) -> int:
    from relight.benchmarks.cli import main as bench_main
    return bench_main(argv)


def _plan(argv: list[str]) -> int:
    from relight.runtime.goodput_plan import main as plan_main
    return plan_main(argv)


SUBCOMMANDS: dict[str, tuple[Callable[[list[str]], int], str]] = {
    "train": (_train, "train in this process or under torchrun (one rank per process)"),
    "run": (_run, "launch an elastic multi-rank job (torchrun agent, etcd rendezvous)"),
    "data": (_data, "prepare token datasets (text, JSONL, Parquet) and inspect them"),
    "ckpt": (_ckpt, "list, inspect, verify, gc, export, import and diff checkpoints"),
    "chaos": (_chaos, "run a chaos scenario and check the recovery invariants"),
    "bench": (_bench, "run a benchmark against its baseline"),
    "plan": (_plan, "checkpoint interval and goodput planning (Young/Daly)"),
}

EXIT_USAGE = 2


def _usage() -> str:
    width = max(len(name) for name in SUBCOMMANDS)
    lines = [
        "usage: relight <command> [options]",
        "",
        "Relight: fault-tolerant parallel training for PyTorch.",
        "",
        "commands:",
    ]
    lines += [f"  {name:<{width}}  {text}" for name, (_, text) in SUBCOMMANDS.items()]
    lines += ["", "Run `relight <command> --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0 if args else EXIT_USAGE
    name, rest = args[0], args[1:]
    if name not in SUBCOMMANDS:
        print(f"relight: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return EXIT_USAGE
    return int(SUBCOMMANDS[name][0](rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
