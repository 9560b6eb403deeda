"""Scale by simulation: ``relight bench scale [--quick] [--cap S] [--md OUT.md]``.

What grows with the number of ranks, measured at 64 ... 16,384 simulated ranks on one
machine, side by side with torch.distributed.checkpoint (DCP) where DCP has the same
step:

* planning (`benchmarks.scale_plan`): save and load plans of model-shaped state dicts
  (Llama-3-8B, -70B, a 64-expert MoE; parameters and two Adam moments, shapes only)
  on FSDP, HSDP, FSDP x TP x PP and EP meshes; Relight's planners and DCP's, seconds and
  peak memory per world size, each system in its own process; a DCP arm past the time
  cap is stopped and reported as "> cap";
* the manifest built from each plan: bytes and parse time (DCP: its pickled metadata);
* commit (`benchmarks.scale_commit`): N index objects, the coordinator's collection,
  manifest + marker, and the restore's manifest reads, on local disk and on S3;
* rendezvous (`benchmarks.scale_rdzv`): N agents joining one round against one etcd.

Each figure gets a markdown table and a log-log PNG with its fitted growth exponent.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import queue
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relight.benchmarks.scale_commit import CommitConfig, run_commit
from relight.benchmarks.scale_rdzv import RdzvConfig, run_rendezvous
from relight.benchmarks.scale_report import fmt, growth_exponent, plot
from relight.benchmarks.scale_state import CONFIGS, MESHES, MODELS, state_bytes

__all__ = ["ScaleConfig", "run", "main"]

ROOT = Path(__file__).resolve().parents[1]
TARGET_CONFIG = "70b-3d"


@dataclass(kw_only=True)
class ScaleConfig:
    configs: tuple[str, ...] = tuple(CONFIGS)
    """(model, mesh) pairs to plan for (`benchmarks.scale_state.CONFIGS`)."""
    worlds: tuple[int, ...] = (64, 256, 1024, 4096, 16384)
    """World sizes, ascending."""
    max_world: int = 4096
    """Largest world for configs other than the 70B target layout (their per-rank piece
    lists reach tens of millions beyond it: memory this machine does not have)."""
    cap_s: float = 300.0
    """A planning arm (one world size) longer than this is stopped: "> cap"."""
    commit: CommitConfig = field(default_factory=CommitConfig)
    rdzv: RdzvConfig = field(default_factory=RdzvConfig)
    parts: tuple[str, ...] = ("plan", "commit", "rdzv")
    systems: tuple[str, ...] = ("relight", "dcp")
    plan_nice: int = 0
    """Niceness of the planning workers: on a shared machine they then yield to others,
    and their figures (CPU seconds) stay what they would be on an idle core."""

    def __post_init__(self) -> None:
        unknown = set(self.configs) - set(CONFIGS)
        if unknown:
            raise ValueError(f"unknown configs {sorted(unknown)}; known: {sorted(CONFIGS)}")
        if list(self.worlds) != sorted(self.worlds):
            raise ValueError("world sizes must be ascending")


def _load() -> float:
    return os.getloadavg()[0]


def _arms(config: str, system: str, worlds: list[int], cap_s: float,
          manifest_dir: str | None, log: Any, nice: int = 0) -> list[dict[str, Any]]:
    """Run one worker over `worlds`; a world whose timed part passes `cap_s` (or whose
    inputs take longer than that to build) ends the worker: it and the larger worlds
    are reported over the cap."""
    cmd = [sys.executable, "-m", "relight.benchmarks.scale_plan", "--system", system, "--config",
           config, "--worlds", ",".join(map(str, worlds))]
    if manifest_dir:
        cmd += ["--manifest-dir", manifest_dir]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                            preexec_fn=(lambda: os.nice(nice)) if nice else None)
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    rows: list[dict[str, Any]] = []
    pending = list(worlds)
    try:
        while pending:
            w = pending[0]
            load0 = _load()
            deadline = time.monotonic() + cap_s  # building inputs, then the timed part
            started = False
            row: dict[str, Any] | None = None
            partial: dict[str, Any] | None = None
            while row is None:
                try:
                    line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if line is None:
                    break
                doc = json.loads(line)
                if doc["event"] == "start":
                    started, deadline = True, time.monotonic() + cap_s
                elif doc["event"] == "partial":
                    partial = doc
                elif doc["event"] == "result":
                    row = doc
            if row is None and partial is not None:
                partial.pop("event")
                rows.append({**partial, "manifest_over_cap": True, "load_before": load0})
                log(f"plan {config} {system} world {w}: manifest > cap ({cap_s:.0f} s)")
                rows += [{"world": rest, "over_cap": True, "why": "worker stopped",
                          "cap_s": cap_s} for rest in pending[1:]]
                break
            if row is None:
                why = "over cap" if proc.poll() is None else f"worker exited {proc.poll()}"
                for rest in pending:
                    rows.append({"world": rest, "over_cap": True, "why": why,
                                 "cap_s": cap_s, "inputs_built": started and rest == w})
                log(f"plan {config} {system} world {w}: > cap ({cap_s:.0f} s) ({why})")
                break
            row.pop("event")
            row["load_before"], row["load_after"] = load0, _load()
            rows.append(row)
            log(f"plan {config} {system} world {w}: save {row['save_s']:.3f} s, load "
                f"{row['load_s']:.3f} s CPU (wall {row['save_wall_s']:.1f} + "
                f"{row['load_wall_s']:.1f} s, load avg {load0:.1f})")
            pending.pop(0)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    return rows


def run(cfg: ScaleConfig, log: Any = print) -> dict[str, Any]:
    out: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version()},
        "load_start": os.getloadavg(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                time.gmtime()),
        "cap_s": cfg.cap_s, "plan": {}, "models": {
            c: {"model": CONFIGS[c][0], "mesh": CONFIGS[c][1],
                "state_bytes": state_bytes(MODELS[CONFIGS[c][0]])} for c in cfg.configs},
    }
    with tempfile.TemporaryDirectory(prefix="scale-manifests-") as mdir:
        if "plan" in cfg.parts:
            for c in cfg.configs:
                worlds = [w for w in cfg.worlds if c == TARGET_CONFIG or w <= cfg.max_world]
                worlds = [w for w in worlds if _fits(c, w)]
                keep = mdir if c == TARGET_CONFIG else None
                out["plan"][c] = {s: _arms(c, s, worlds, cfg.cap_s, keep, log, cfg.plan_nice)
                                  for s in cfg.systems}
        if "commit" in cfg.parts:
            manifests = {n: Path(mdir) / f"w{n}.json" for n in cfg.commit.sizes}
            commit = cfg.commit if cfg.commit.manifest_for else dataclasses.replace(
                cfg.commit, manifest_for=manifests)
            out["commit"] = run_commit(commit, log)
    if "rdzv" in cfg.parts:
        out["rdzv"] = run_rendezvous(cfg.rdzv, log)
    out["load_end"] = os.getloadavg()
    return out


def _fits(config: str, world: int) -> bool:
    try:
        MESHES[CONFIGS[config][1]].at(world)
        return True
    except ValueError:
        return False


# --------------------------------------------------------------------------- report


def _plan_rows(res: dict[str, Any], config: str) -> tuple[list[int], dict[str, dict[int, Any]]]:
    by: dict[str, dict[int, Any]] = {}
    worlds: set[int] = set()
    for system, rows in res["plan"][config].items():
        for r in rows:
            by.setdefault(system, {})[r["world"]] = r
            worlds.add(r["world"])
    return sorted(worlds), by


def _cell(row: Any, key: str, unit: str, cap: float) -> str:
    if row is None:
        return "-"
    if row.get("over_cap") or (row.get("manifest_over_cap") and key.startswith("manifest")):
        return f"> {cap:.0f} s" if unit == "s" else "-"
    return fmt(row.get(key), unit)


def _k(xs: list[int], rows: dict[int, Any], key: str) -> str:
    k = growth_exponent(xs, [None if rows.get(x) is None or rows[x].get("over_cap")
                             else rows[x].get(key) for x in xs])
    return "-" if k is None else f"{k:.2f}"


def markdown(res: dict[str, Any], command: str) -> str:
    cap = res["cap_s"]
    lines = [
        f"Machine: {res['machine']['cpus']} CPUs, {res['machine']['platform']}, Python "
        f"{res['machine']['python']}; 1-min load average {res['load_start'][0]:.1f} at the "
        f"start, {res['load_end'][0]:.1f} at the end. Command: `{command}`.", "",
    ]
    for c in res["plan"]:
        m = res["models"][c]
        worlds, by = _plan_rows(res, c)
        rl, dc = by.get("relight", {}), by.get("dcp", {})
        lines += [f"### Planning: {m['model']} on {m['mesh']} "
                  f"({m['state_bytes'] / 1e9:.0f} GB of state)", "",
                  "CPU seconds of one process: Relight's plan, which every rank computes; "
                  "DCP save: the coordinator's global plan; DCP load: the slowest sampled "
                  "rank's local plan. Peak memory: RSS above the start of the step.", "",
                  "| ranks | pieces | Relight save | DCP save | Relight load | DCP load "
                  "(per rank) | Relight peak MiB (save/load) | DCP peak MiB (save/load) "
                  "| load avg |",
                  "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for w in worlds:
            r, d = rl.get(w), dc.get(w)
            pieces = (r or d or {}).get("pieces", "-")
            mem_r = "-" if not r or r.get("over_cap") else \
                f"{r['save_mib']:.0f} / {r['load_mib']:.0f}"
            mem_d = "-" if not d or d.get("over_cap") else \
                f"{d['save_mib']:.0f} / {d['load_mib']:.0f}"
            la = (r or {}).get("load_before")
            lines.append(
                f"| {w} | {pieces} | {_cell(r, 'save_s', 's', cap)} | "
                f"{_cell(d, 'save_s', 's', cap)} | {_cell(r, 'load_s', 's', cap)} | "
                f"{_cell(d, 'load_s', 's', cap)} | {mem_r} | {mem_d} | "
                f"{'-' if la is None else f'{la:.1f}'} |")
        lines += [f"| growth exponent | | {_k(worlds, rl, 'save_s')} | "
                  f"{_k(worlds, dc, 'save_s')} | {_k(worlds, rl, 'load_s')} | "
                  f"{_k(worlds, dc, 'load_s')} | | | |", ""]
        lines += ["| ranks | manifest | manifest parse | chunk crc32c table | DCP .metadata "
                  "| .metadata unpickle |",
                  "| ---: | ---: | ---: | ---: | ---: | ---: |"]
        for w in worlds:
            r, d = rl.get(w), dc.get(w)
            lines.append(f"| {w} | {_cell(r, 'manifest_bytes', 'B', cap)} | "
                         f"{_cell(r, 'manifest_parse_s', 's', cap)} | "
                         f"{_cell(r, 'crc_table_bytes', 'B', cap)} | "
                         f"{_cell(d, 'metadata_bytes', 'B', cap)} | "
                         f"{_cell(d, 'metadata_parse_s', 's', cap)} |")
        lines += [f"| growth exponent | {_k(worlds, rl, 'manifest_bytes')} | "
                  f"{_k(worlds, rl, 'manifest_parse_s')} | "
                  f"{_k(worlds, rl, 'crc_table_bytes')} | {_k(worlds, dc, 'metadata_bytes')} "
                  f"| {_k(worlds, dc, 'metadata_parse_s')} |", ""]
    for target, rows in res.get("commit", {}).items():
        if target == "sync":
            lines += ["### Commit over a process group (synchronous saves; asynchronous "
                      "saves' commit group)", "",
                      "Bytes and parse: per rank at that world size. Head, gather, outcome: "
                      "the commit group's collectives on real processes of this machine "
                      "carrying the same bytes (the process count is in the JSON). Commit "
                      "on S3: head + gather + outcome + parse + the S3 table, manifest and "
                      "marker.", "",
                      "| ranks | coordinator receives | coordinator parses | any other rank "
                      "receives | head | gather | outcome | commit on S3 |",
                      "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
            lines += [f"| {r['ranks']} | {fmt(r['coordinator_bytes'], 'B')} | "
                      f"{fmt(r['coordinator_parse_s'])} | {fmt(r['other_bytes'], 'B')} | "
                      f"{fmt(r.get('head_s'))} | {fmt(r.get('gather_s'))} | "
                      f"{fmt(r.get('outcome_s'))} | {fmt(r.get('group_commit_s3_s'))} |"
                      for r in rows]
            lines.append("")
            continue
        lines += [f"### Commit on {target}", "",
                  "| ranks | index objects written | collect | table + manifest + marker | "
                  "commit overhead | manifest | manifest read (per rank, 16 at once) |",
                  "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in rows:
            lines.append(f"| {r['ranks']} | {fmt(r['write_s'])} | {fmt(r['collect_s'])} | "
                         f"{fmt(r['publish_s'])} | {fmt(r['commit_s'])} | "
                         f"{fmt(r['manifest_bytes'], 'B')} | {fmt(r['read_per_rank_s'])} |")
        xs = [r["ranks"] for r in rows]
        lines += [f"| growth exponent | {_kx(xs, rows, 'write_s')} | "
                  f"{_kx(xs, rows, 'collect_s')} | {_kx(xs, rows, 'publish_s')} | "
                  f"{_kx(xs, rows, 'commit_s')} | | |", ""]
    if res.get("rdzv"):
        rows = res["rdzv"]
        lines += ["### Rendezvous", "",
                  "| agents | round complete | time | etcd requests | per agent | CAS "
                  "conflicts | keepalives |", "| ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
        for r in rows:
            lines.append(f"| {r['agents']} | {'yes' if r['complete'] else 'no'} | "
                         f"{fmt(r['round_s'])} | {r['requests']} | "
                         f"{r['requests_per_agent']:.1f} | {r['cas_conflicts']} | "
                         f"{r['keepalives']} |")
        xs = [r["agents"] for r in rows]
        lines += [f"| growth exponent | | {_kx(xs, rows, 'round_s')} | "
                  f"{_kx(xs, rows, 'requests')} | | {_kx(xs, rows, 'cas_conflicts')} | |", ""]
    return "\n".join(lines)


def _kx(xs: list[int], rows: list[dict[str, Any]], key: str) -> str:
    k = growth_exponent(xs, [r.get(key) for r in rows])
    return "-" if k is None else f"{k:.2f}"


def plots(res: dict[str, Any], out_dir: Path, stem: str) -> list[Path]:
    made = []

    def series(key: str, system: str) -> list[tuple[str, list[int], list[Any]]]:
        got = []
        for c in res["plan"]:
            worlds, by = _plan_rows(res, c)
            rows = by.get(system, {})
            ys = [None if rows.get(w) is None or rows[w].get("over_cap") else rows[w].get(key)
                  for w in worlds]
            got.append((f"{system} {c}", worlds, ys))
        return got

    if res["plan"]:
        for key, title, target in (("save_s", "save planning", 1.0),
                                   ("load_s", "load planning", 1.0)):
            p = out_dir / f"{stem}-{key.split('_')[0]}-plan.png"
            plot(p, title, "ranks", "seconds", series(key, "relight") + series(key, "dcp"),
                 target)
            made.append(p)
        p = out_dir / f"{stem}-manifest.png"
        plot(p, "manifest bytes (Relight) and .metadata bytes (DCP)", "ranks", "bytes",
             series("manifest_bytes", "relight") + series("metadata_bytes", "dcp"), 10e6)
        made.append(p)
        p = out_dir / f"{stem}-manifest-parse.png"
        plot(p, "manifest parse (Relight) and .metadata unpickle (DCP)", "ranks", "seconds",
             series("manifest_parse_s", "relight") + series("metadata_parse_s", "dcp"), 0.5)
        made.append(p)
    if res.get("commit"):
        p = out_dir / f"{stem}-commit.png"
        plot(p, "commit overhead (collect + manifest + marker)", "ranks", "seconds",
             [(f"{t} {k}", [r["ranks"] for r in rows], [r[k] for r in rows])
              for t, rows in res["commit"].items() if t != "sync"
              for k in ("collect_s", "commit_s")]
             + [("S3 commit over a process group",
                 [r["ranks"] for r in over], [r["group_commit_s3_s"] for r in over])
                for over in [[r for r in res["commit"].get("sync", [])
                              if "group_commit_s3_s" in r]] if over], 2.0)
        made.append(p)
    if res.get("rdzv"):
        rows = res["rdzv"]
        p = out_dir / f"{stem}-rendezvous.png"
        xs = [r["agents"] for r in rows]
        plot(p, "rendezvous of N agents on one etcd", "agents", "seconds / requests",
             [("round seconds", xs, [r["round_s"] for r in rows]),
              ("etcd requests", xs, [r["requests"] for r in rows]),
              ("CAS conflicts", xs, [r["cas_conflicts"] or None for r in rows])], 10.0)
        made.append(p)
    return made


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="relight bench scale",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="tiny sizes (8..64 ranks, 4..16 agents, 30 s cap): a smoke run")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--worlds", default=None, help="e.g. 64,256,1024,4096,16384")
    ap.add_argument("--max-world", type=int, default=4096)
    ap.add_argument("--cap", type=float, default=None, help="seconds per planning arm (300)")
    ap.add_argument("--commit-sizes", default=None, help="e.g. 64,256,1024,4096")
    ap.add_argument("--agents", default=None, help="rendezvous sizes, e.g. 64,256,1024")
    ap.add_argument("--rdzv-timeout", type=float, default=120.0)
    ap.add_argument("--lease-ttl", type=float, default=10.0,
                    help="agents' lease TTL (a loaded machine starves 1,024 keepalive threads)")
    ap.add_argument("--agent-procs", type=int, default=0,
                    help="worker processes the rendezvous agents are spread over "
                         "(0: min(8, N))")
    ap.add_argument("--no-s3", action="store_true", help="commit on local disk only")
    ap.add_argument("--group-procs", type=int, default=None,
                    help="processes of the commit group's measured collectives (0: none; "
                         "default 8, 2 with --quick)")
    ap.add_argument("--parts", default="plan,commit,rdzv")
    ap.add_argument("--systems", default="relight,dcp", help="planning arms to run")
    ap.add_argument("--plan-nice", type=int, default=0,
                    help="run the planning workers at this niceness (they report CPU seconds)")
    ap.add_argument("--json", default=None, help="write the raw results here")
    ap.add_argument("--md", default=None, help="write the markdown tables here")
    ap.add_argument("--plots", default=None, help="directory for the PNG plots")
    args = ap.parse_args(argv)
    quick = args.quick
    cfg = ScaleConfig(
        configs=tuple(c for c in args.configs.split(",") if c),
        worlds=_ints(args.worlds) if args.worlds else ((64,) if quick else
                                                       (64, 256, 1024, 4096, 16384)),
        max_world=args.max_world,
        cap_s=args.cap if args.cap is not None else (30.0 if quick else 300.0),
        commit=CommitConfig(
            sizes=_ints(args.commit_sizes) if args.commit_sizes else
            ((8, 32) if quick else (64, 256, 1024, 4096)), s3=not args.no_s3,
            group_procs=args.group_procs if args.group_procs is not None else
            (2 if quick else 8)),
        rdzv=RdzvConfig(agents=_ints(args.agents) if args.agents else
                        ((4, 16) if quick else (64, 256, 1024)),
                        timeout_s=args.rdzv_timeout, lease_ttl_s=args.lease_ttl,
                        agent_procs=args.agent_procs),
        parts=tuple(p for p in args.parts.split(",") if p),
        plan_nice=args.plan_nice,
        systems=tuple(x for x in args.systems.split(",") if x),
    )
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    res = run(cfg, log)
    command = "relight bench scale " + " ".join(argv if argv is not None else sys.argv[1:])
    res["command"] = command.strip()
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    text = markdown(res, res["command"])
    if args.plots:
        stem = Path(args.md).stem if args.md else "scale"
        for p in plots(res, Path(args.plots), stem):
            text += f"\n![{p.stem}]({os.path.relpath(p, Path(args.md).parent) if args.md else p})"
        text += "\n"
    if args.md:
        Path(args.md).write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
