"""`relight bench <name> [options]`: run one benchmark against its baseline.

Each benchmark is a module of this package with `main(argv) -> int` and its own
`--help`; this only dispatches.
"""

from __future__ import annotations

import importlib
import sys

__all__ = ["BENCHMARKS", "main"]

BENCHMARKS: dict[str, str] = {
    "ckpt": "checkpoint save/load/reshard vs torch.distributed.checkpoint (DCP)",
    "layouts": "each parallel layout vs plain data parallelism on the same ranks",
    "recovery": "kill -> first step after resume vs torchrun c10d + DCP",
}


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help") or args[0] not in BENCHMARKS:
        lines = ["usage: relight bench <name> [options]   (relight bench <name> --help)", ""]
        lines += [f"  {name:<9} {text}" for name, text in BENCHMARKS.items()]
        known = not args or args[0] in ("-h", "--help")
        if not known:
            lines.insert(0, f"relight bench: unknown benchmark {args[0]!r}")
        print("\n".join(lines), file=sys.stdout if known else sys.stderr)
        return 0 if args and known else 2
    module = importlib.import_module(f"benchmarks.{args[0]}")
    return int(module.main(args[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
