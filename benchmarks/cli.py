"""`relight bench <name> [options]`: run one benchmark against its baseline.

Each benchmark is a module of this package with `main(argv) -> int` and its own
`--help`; this only dispatches, with a spinner and the elapsed time on stderr while it runs
(only when stderr is a terminal; each benchmark's `--json FILE` writes its results to a
file, never to the terminal).

Exit status: 0 the benchmark ran; 2 unknown benchmark or usage error; otherwise the
benchmark's own status (see `relight bench NAME --help`).
"""

from __future__ import annotations

import importlib
import sys

__all__ = ["BENCHMARKS", "main"]

BENCHMARKS: dict[str, str] = {
    "ckpt": "checkpoint save/load/reshard vs torch.distributed.checkpoint (DCP)",
    "layouts": "each parallel layout vs plain data parallelism on the same ranks",
    "recovery": "kill -> first step after resume vs torchrun c10d + DCP",
    "data": "token-dataset preparation throughput and the loader's cost per step",
    "scale": "planning, manifest, commit, rendezvous at 64..16,384 simulated ranks vs DCP",
    "goodput": "healing in place vs the restart path vs torchft, same failures (MTBF)",
    "cross_group": "replica groups of different layouts vs one layout: reduction and heal",
    "scale_heal": "heal in place at 4..1,024 simulated groups on a 3-member etcd vs torchft",
}


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help") or args[0] not in BENCHMARKS:
        lines = ["usage: relight bench <name> [options]   (relight bench <name> --help)", ""]
        lines += [f"  {name:<11} {text}" for name, text in BENCHMARKS.items()]
        lines += ["", "exit status: 0 ran; 2 unknown benchmark or usage error; else the "
                  "benchmark's own"]
        known = not args or args[0] in ("-h", "--help")
        if not known:
            lines.insert(0, f"relight bench: unknown benchmark {args[0]!r}")
        print("\n".join(lines), file=sys.stdout if known else sys.stderr)
        return 0 if args and known else 2
    module = importlib.import_module(f"{__package__}.{args[0]}")
    rest = args[1:]
    if any(a in ("-h", "--help") for a in rest):
        return int(module.main(rest) or 0)
    from relight.ckpt.cli import ProgressBar

    with ProgressBar(f"bench {args[0]}", enabled=True, unit="items"):
        return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
