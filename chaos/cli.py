"""`relight chaos`: run a chaos scenario, check a training script against the contract, or
re-render a report.

    relight chaos run SCENARIO [--seed N] [--out DIR] [--junit FILE] [--reference-cache DIR]
                               [--keep-etcd-data] [--json]
    relight chaos check-script [--nproc N] [--interval I] [--env K=V] [--out DIR]
                               SCRIPT_OR_SCENARIO [ARGS...]
    relight chaos report DIR [--junit FILE] [--json]

--json prints the whole report (report.json) on stdout instead of the summary.

Exit status: 0 when every invariant holds, 1 when any is broken, 2 for a usage or scenario
error, 3 when the harness itself could not run (a server or the launcher failed).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from relight.chaos.report import load_report, render_markdown, write_junit, write_report
from relight.chaos.scenario import Scenario, ScenarioError, load_scenario, parse_scenario

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
                     help="reuse (or store) the reference run here, keyed by the training "
                          "setup and the content of the script and its local imports")
    run.add_argument("--keep-etcd-data", action="store_true",
                     help="keep etcd's data directory in the output (tens of MB; by "
                          "default only etcd's log is kept)")
    chk = sub.add_parser(
        "check-script", help="run a training script a few steps without faults, stop and "
        "resume it, and say which parts of the contract it misses",
        description="SCRIPT is a Python script (its arguments after it) or a scenario "
        "TOML (its [training], [checkpoint] and cluster size are used).")
    chk.add_argument("--nproc", type=int, default=None,
                     help="ranks on the one node (default: the scenario's world size, "
                          "else 2)")
    chk.add_argument("--interval", type=int, default=None,
                     help="checkpoint interval (default: the scenario's, else 5)")
    chk.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                     help="extra environment for the script (repeatable)")
    chk.add_argument("--out", default=None,
                     help="where the three runs go (default: a temporary directory, "
                          "deleted unless something is missing)")
    chk.add_argument("script")
    chk.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
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
    lines += [f"  note: {note}" for note in report.get("notes", [])]
    return "\n".join(lines)


def _check_scenario(args: argparse.Namespace) -> Scenario:
    """The scenario `check-script` runs: the TOML given, or one made for the script."""
    if args.script.endswith(".toml"):
        scenario = load_scenario(args.script)
    else:
        env = dict(kv.split("=", 1) for kv in args.env if "=" in kv)
        scenario = parse_scenario({"name": "check-script",
                                   "training": {"command": [args.script, *args.args],
                                                "env": env}})
    if scenario.cluster.replica_groups:
        raise ScenarioError("cluster.replica_groups",
                            "check-script runs one group; check a replica script's "
                            "scenario with `relight chaos run`")
    if args.interval is not None:
        scenario = dataclasses.replace(
            scenario, checkpoint=dataclasses.replace(scenario.checkpoint,
                                                     interval=args.interval))
    return scenario


def _check_script(args: argparse.Namespace) -> int:
    from relight.chaos.check_script import check_script
    from relight.chaos.commands import TrainingFileError, check_training_files

    try:
        scenario = _check_scenario(args)
        check_training_files(scenario)
    except (ScenarioError, TrainingFileError) as exc:
        print(f"relight chaos check-script: {exc}", file=sys.stderr)
        return EXIT_USAGE
    nproc = args.nproc or (scenario.cluster.world_size if args.script.endswith(".toml")
                           else 2)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="relight-check-"))
    try:
        findings = check_script(scenario, out.resolve(), nproc)
    except Exception as exc:  # noqa: BLE001 - the harness failing is its own exit status
        logger.exception("check-script failed")
        print(f"relight chaos check-script: the harness failed ({type(exc).__name__}: "
              f"{exc}); see {out}", file=sys.stderr)
        return EXIT_HARNESS
    missing = [f for f in findings if f.level == "missing"]
    print(f"relight chaos check-script {args.script}: "
          + (f"{len(missing)} part(s) of the contract missing" if missing
             else "meets the contract"))
    print("\n".join(f.line() for f in findings))
    if missing or args.out:
        print(f"runs, logs and checkpoints: {out}")
    else:
        shutil.rmtree(out, ignore_errors=True)
    return EXIT_BROKEN if missing else EXIT_OK


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not logging.getLogger().handlers:
        # check-script's answer is its findings; the harness's progress lines would bury them.
        quiet = "WARNING" if args.command == "check-script" else "INFO"
        logging.basicConfig(level=os.environ.get("RELIGHT_LOG_LEVEL", quiet),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "check-script":
        return _check_script(args)
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
    from relight.chaos.commands import TrainingFileError, check_training_files
    from relight.chaos.runner import run_scenario

    try:
        check_training_files(scenario)
    except TrainingFileError as exc:
        print(f"relight chaos run: {exc}", file=sys.stderr)
        return EXIT_USAGE

    # A SIGTERM (a CI runner cancelling the job) unwinds through the runner's teardown
    # and exits 143: run_scenario installs the handler for every caller.
    t0 = time.monotonic()
    try:
        result = run_scenario(scenario, out, seed=seed, junit=args.junit,
                              reference_cache=args.reference_cache,
                              keep_etcd_data=args.keep_etcd_data)
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
