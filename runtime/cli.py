"""`relight`: one command for training, launching, checkpoints, chaos and benchmarks.

Each subcommand lives with the package that owns it and exposes `main(argv) -> int`;
this module only dispatches. The modules are imported by name, lazily, so
`relight --help` is fast and the library packages keep their one-way imports
(the CLI is the application on top, not part of `runtime`'s library surface).
"""

from __future__ import annotations

import importlib
import sys

__all__ = ["main", "SUBCOMMANDS"]

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "train": ("runtime.train", "train in this process or under torchrun (one rank per process)"),
    "run": ("elastic.launch", "launch an elastic multi-rank job (torchrun agent, etcd rendezvous)"),
    "data": ("runtime.prepare", "prepare token datasets (text, JSONL, Parquet) and inspect them"),
    "ckpt": ("ckpt.cli", "list, inspect, verify, gc, export, import and diff checkpoints"),
    "chaos": ("chaos.cli", "run a chaos scenario and check the recovery invariants"),
    "bench": ("benchmarks.cli", "run a benchmark against its baseline"),
    "plan": ("runtime.goodput_plan", "checkpoint interval and goodput planning (Young/Daly)"),
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
    module_name = SUBCOMMANDS[name][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        print(f"relight {name}: not available in this build ({module_name} missing)",
              file=sys.stderr)
        return EXIT_USAGE
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
