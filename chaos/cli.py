"""`relight chaos`: run a chaos scenario, or re-render a report.

    relight chaos run SCENARIO [--seed N] [--out DIR] [--junit FILE] [--reference-cache DIR]
                               [--json]
    relight chaos report DIR [--junit FILE] [--json]

--json prints the whole report (report.json) on stdout instead of the summary.

Exit status: 0 when every invariant holds, 1 when any is broken, 2 for a usage or scenario
error, 3 when the harness itself could not run (a server or the launcher failed).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

from relight.chaos.report import load_report, render_markdown, write_junit, write_report
from relight.chaos.scenario import ScenarioError, load_scenario

logger = logging.getLogger(__name__)

__all__ = ["main"]

EXIT_OK, EXIT_BROKEN, EXIT_USAGE, EXIT_HARNESS = 0, 1, 2, 3


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="relight chaos", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n")[-1])
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a scenario and check the invariants")
    run.add_argument("scenario", help="scenario TOML, e.g. scenarios/ci-smoke.toml")
    run.add_argument("--seed", type=int, default=None, help="override the scenario's seed")
    run.add_argument("--out", default=None,
                     help="output directory (default runs/chaos/<scenario>-seed<N>)")
    run.add_argument("--junit", default=None, help="also write JUnit XML here")
    run.add_argument("--reference-cache", default=None,
                     help="reuse (or store) the reference run here, keyed by training setup")
    rep = sub.add_parser("report", help="re-render report.md/loss.png from DIR/report.json")
    rep.add_argument("dir")
    rep.add_argument("--junit", default=None, help="also write JUnit XML here")
    for sp in (run, rep):
        sp.add_argument("--json", action="store_true",
                        help="print the report as JSON on stdout instead of the summary")
    return p


def _summary(report: dict) -> str:
    lines = [f"chaos {report['scenario']} seed {report['seed']}: "
             f"{'PASSED' if report['passed'] else 'FAILED'} in {report['wall_s']:.1f} s"]
    for inv in report["invariants"]:
        lines.append(f"  [{'ok' if inv['ok'] else 'BROKEN'}] {inv['number']}. {inv['name']}: "
                     f"{inv['summary']}")
    rec = report["recovery"]["first_step"]
    if rec["count"]:
        lines.append(f"  recovery (fault -> first step): median {rec['median_s']} s, "
                     f"p90 {rec['p90_s']} s, max {rec['max_s']} s over {rec['count']}")
    lines.append(f"  goodput {report['goodput']['goodput']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=os.environ.get("RELIGHT_LOG_LEVEL", "INFO"),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "report":
        try:
            report = load_report(args.dir)
        except FileNotFoundError as exc:
            print(f"relight chaos report: {exc}", file=sys.stderr)
            return EXIT_USAGE
        write_report(args.dir, report)
        if args.junit:
            write_junit(args.junit, report)
        if args.json:
            print(json.dumps(report, indent=1))
            return EXIT_OK if report["passed"] else EXIT_BROKEN
        print(_summary(report))
        print(render_markdown(report, None) if os.environ.get("RELIGHT_CHAOS_MD") else "",
              end="")
        return EXIT_OK if report["passed"] else EXIT_BROKEN
    try:
        scenario = load_scenario(args.scenario)
    except ScenarioError as exc:
        print(f"relight chaos run: {exc}", file=sys.stderr)
        return EXIT_USAGE
    seed = scenario.seed if args.seed is None else args.seed
    out = Path(args.out or f"runs/chaos/{scenario.name}-seed{seed}")
    from relight.chaos.runner import run_scenario

    # A SIGTERM (a CI runner cancelling the job) unwinds through the runner's teardown
    # and exits 143: run_scenario installs the handler for every caller.
    t0 = time.monotonic()
    try:
        result = run_scenario(scenario, out, seed=seed, junit=args.junit,
                              reference_cache=args.reference_cache)
    except Exception as exc:  # noqa: BLE001 - the harness failing is its own exit status
        logger.exception("the chaos harness failed")
        print(f"relight chaos run: the harness failed ({type(exc).__name__}: {exc}); "
              f"see the logs under {out}", file=sys.stderr)
        return EXIT_HARNESS
    if args.json:
        print(json.dumps(result.report, indent=1))
        return EXIT_OK if result.passed else EXIT_BROKEN
    print(_summary(result.report))
    print(f"report: {result.out_dir / 'report.md'} ({time.monotonic() - t0:.1f} s in all)")
    return EXIT_OK if result.passed else EXIT_BROKEN


if __name__ == "__main__":
    sys.exit(main())
