"""The chaos report: `report.json` (everything measured), `report.md` (for people),
`loss.png` (loss vs step, the reference beside it, each fault marked) and JUnit XML (for CI).

`write_report(out_dir, report)` writes all but JUnit; `write_junit(path, report)` writes that.
Both take the JSON-able dict `build_report` makes, so `relight chaos report DIR` can
re-render everything from `report.json` alone.

The PNG is drawn with matplotlib when it is installed; otherwise with the small rasterizer
below (lines and markers, no text: the Markdown carries the legend), so a report always
has its plot.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import struct
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from xml.etree import ElementTree as ET

from relight.chaos.logs import StepRecord, effective_history, job_history, split_attempts
from relight.chaos.verifier import InvariantResult

logger = logging.getLogger(__name__)

__all__ = [
    "build_report",
    "load_report",
    "percentile",
    "render_markdown",
    "write_junit",
    "write_png",
    "write_report",
]


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    k = max(0, math.ceil(q / 100 * len(ordered)) - 1)
    return ordered[k]


def _dist(values: Sequence[float]) -> dict[str, Any]:
    return {
        "count": len(values),
        "median_s": round(statistics.median(values), 3) if values else None,
        "p90_s": percentile(values, 90),
        "max_s": max(values) if values else None,
        "values_s": [round(v, 3) for v in values],
    }


def build_report(
    *,
    scenario: dict[str, Any],
    seed: int,
    results: Sequence[InvariantResult],
    faults: Sequence[dict[str, Any]],
    records: Sequence[StepRecord],
    reference: Sequence[StepRecord] | None,
    started_at: float,
    ended_at: float,
    reference_wall_s: float | None,
    notes: Sequence[str] = (),
    replica_groups: int | None = None,
) -> dict[str, Any]:
    """The report as plain data. `faults` are `FaultEvent.to_dict()`s (times relative to
    each fault in `detect_s`, `rendezvous_s`, `first_step_s`). `replica_groups`: the
    groups the job started with, when each node was a replica group; the attempts and
    curves are then the job's (each step once), and `goodput.fleet_goodput` weighs each
    step by the share of the groups that trained it."""
    wall = ended_at - started_at
    fleet_useful = None
    if replica_groups:
        fleet_useful = sum((r.step_time_s or 0.0) * (r.quorum_size or 0) / replica_groups
                           for r in job_history(records))
        records = job_history(records)
    hist = effective_history(records)
    useful = sum(r.step_time_s or 0.0 for r in hist.values())
    recovery = [f["first_step_s"] for f in faults if f.get("first_step_s") is not None]
    detect = [f["detect_s"] for f in faults if f.get("detect_s") is not None]
    rdzv = [f["rendezvous_s"] for f in faults if f.get("rendezvous_s") is not None]
    attempts = split_attempts(records)
    attempt_of = {id(r): a.index for a in attempts for r in a.records}
    lost = next((r.measured.get("resumes", []) for r in results if r.number == 4), [])
    return {
        "scenario": scenario.get("name"),
        "seed": seed,
        "passed": all(r.ok for r in results),
        "started_at": started_at,
        "wall_s": round(wall, 3),
        "reference_wall_s": None if reference_wall_s is None else round(reference_wall_s, 3),
        "target_step": scenario.get("target_step"),
        "invariants": [r.to_dict() for r in results],
        "faults": list(faults),
        "recovery": {"first_step": _dist(recovery), "detect": _dist(detect),
                     "rendezvous": _dist(rdzv)},
        "lost_steps": lost,
        "goodput": {
            "useful_step_s": round(useful, 3),
            "wall_s": round(wall, 3),
            "goodput": round(useful / wall, 4) if wall > 0 else None,
            **({"fleet_goodput": round(fleet_useful / wall, 4) if wall > 0 else None}
               if fleet_useful is not None else {}),
        },
        "attempts": [
            {"index": a.index, "restored_step": a.restored_step, "first_step": a.first.step,
             "last_step": a.last.step, "world_size": a.first.world_size,
             "layout": a.first.layout}
            for a in attempts
        ],
        "curves": {
            "chaos": [[r.step, r.loss, r.time, attempt_of[id(r)]] for r in records],
            "reference": [[r.step, r.loss] for r in (reference or [])],
        },
        "notes": list(notes),
        "scenario_config": scenario,
    }


def load_report(out_dir: str | Path) -> dict[str, Any]:
    path = Path(out_dir) / "report.json"
    if not path.is_file():
        raise FileNotFoundError(f"no report.json in {out_dir}: run `relight chaos run` first")
    return json.loads(path.read_text())


def _fmt(v: Any, unit: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.2f}{unit}"
    return f"{v}{unit}"


def render_markdown(rep: dict[str, Any], png_name: str | None = "loss.png") -> str:
    verdict = "PASSED" if rep["passed"] else "FAILED"
    lines = [
        f"# Chaos report: {rep['scenario']} (seed {rep['seed']}) - {verdict}",
        "",
        f"Wall time {_fmt(rep['wall_s'], ' s')}, target step {rep['target_step']}, "
        f"reference run {_fmt(rep.get('reference_wall_s'), ' s')}. "
        f"Goodput {_fmt(rep['goodput']['goodput'])} "
        f"(useful step time {_fmt(rep['goodput']['useful_step_s'], ' s')} / wall "
        f"{_fmt(rep['goodput']['wall_s'], ' s')})."
        + (f" Fleet goodput {_fmt(rep['goodput']['fleet_goodput'])} (each step weighted by "
           "the share of the replica groups in its quorum)."
           if "fleet_goodput" in rep["goodput"] else ""),
        "",
        "## Invariants",
        "",
        "| # | invariant | result | tolerance | summary |",
        "| --- | --- | --- | --- | --- |",
    ]
    for inv in rep["invariants"]:
        res = "ok" if inv["ok"] else "**BROKEN**"
        summary = inv["summary"].replace("|", "\\|")
        lines.append(f"| {inv['number']} | {inv['name']} | {res} | {inv['tolerance'] or '-'} "
                     f"| {summary} |")
    broken = [inv for inv in rep["invariants"] if not inv["ok"]]
    for inv in broken:
        lines += ["", f"### {inv['number']}. {inv['name']}: details", ""]
        lines += [f"- {d}" for d in inv["details"]] or ["- (none)"]
    lines += [
        "",
        "## Faults",
        "",
        "| # | kind | trigger | at step | node | injected | detect s | re-rendezvous s | "
        "first step s | detail |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    t0 = rep["started_at"]
    for f in rep["faults"]:
        detail = ", ".join(f"{k}={v}" for k, v in f.get("detail", {}).items())
        injected = f"+{f['time'] - t0:.1f} s" if f["ok"] else f"no: {f['error']}"
        lines.append(
            f"| {f['index']} | {f['kind']} | {f['trigger']} | {f['step']} | "
            f"{_fmt(f.get('node'))} | {injected} | {_fmt(f.get('detect_s'))} | "
            f"{_fmt(f.get('rendezvous_s'))} | {_fmt(f.get('first_step_s'))} | "
            f"{detail.replace('|', '/')} |"
        )
    rec = rep["recovery"]
    lines += ["", "## Recovery time (fault -> ...)", "",
              "| phase | count | median s | p90 s | max s |", "| --- | --- | --- | --- | --- |"]
    for name, key in (("detected", "detect"), ("re-rendezvous", "rendezvous"),
                      ("first step", "first_step")):
        d = rec[key]
        lines.append(f"| {name} | {d['count']} | {_fmt(d['median_s'])} | {_fmt(d['p90_s'])} | "
                     f"{_fmt(d['max_s'])} |")
    lines += ["", "## Resumes", "",
              "| attempt | restored step | first step | last step | world size | layout | "
              "lost steps |", "| --- | --- | --- | --- | --- | --- | --- |"]
    lost = {x["attempt"]: x for x in rep.get("lost_steps", [])}
    for a in rep["attempts"]:
        ls = lost.get(a["index"])
        lost_text = "-" if ls is None else f"{ls['lost_steps']} (<= {ls['allowed']})"
        lines.append(f"| {a['index']} | {_fmt(a['restored_step'])} | {a['first_step']} | "
                     f"{a['last_step']} | {_fmt(a['world_size'])} | {_fmt(a['layout'])} | "
                     f"{lost_text} |")
    if png_name:
        lines += ["", "## Loss", "", f"![loss vs step]({png_name})", "",
                  "Grey: the uninterrupted reference run. Coloured: the chaos run, one colour "
                  "per worker group (attempt). Red verticals: faults, at the step they hit."]
    if rep.get("notes"):
        lines += ["", "## Notes", ""] + [f"- {n}" for n in rep["notes"]]
    return "\n".join(lines) + "\n"


# PNG ----------------------------------------------------------------------------------------

_COLORS = [(31, 119, 180), (44, 160, 44), (255, 127, 14), (148, 103, 189), (23, 190, 207),
           (140, 86, 75), (227, 119, 194), (188, 189, 34)]


def _png_bytes(pixels: bytearray, w: int, h: int) -> bytes:
    raw = b"".join(b"\x00" + bytes(pixels[y * w * 3:(y + 1) * w * 3]) for y in range(h))

    def chunk(tag: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + tag + data
                + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b""))


def _raster_plot(rep: dict[str, Any], path: Path) -> None:
    w, h, m = 900, 500, 40
    px = bytearray(b"\xff" * (w * h * 3))

    def put(x: int, y: int, c: tuple[int, int, int]) -> None:
        if 0 <= x < w and 0 <= y < h:
            i = (y * w + x) * 3
            px[i:i + 3] = bytes(c)

    def line(x0: int, y0: int, x1: int, y1: int, c: tuple[int, int, int], thick: int = 1
             ) -> None:
        n = max(abs(x1 - x0), abs(y1 - y0), 1)
        for i in range(n + 1):
            x, y = x0 + (x1 - x0) * i // n, y0 + (y1 - y0) * i // n
            for dx in range(thick):
                for dy in range(thick):
                    put(x + dx, y + dy, c)

    chaos, ref = rep["curves"]["chaos"], rep["curves"]["reference"]
    pts = [(s, lo) for s, lo, *_ in chaos] + [(s, lo) for s, lo in ref]
    if not pts:
        path.write_bytes(_png_bytes(px, w, h))
        return
    smax = max(s for s, _ in pts) or 1
    lmin, lmax = min(lo for _, lo in pts), max(lo for _, lo in pts)
    span = (lmax - lmin) or 1.0

    def xy(s: float, lo: float) -> tuple[int, int]:
        return (m + int((w - 2 * m) * s / smax), h - m - int((h - 2 * m) * (lo - lmin) / span))

    line(m, h - m, w - m, h - m, (0, 0, 0))
    line(m, m, m, h - m, (0, 0, 0))
    for s in range(0, int(smax) + 1, max(1, int(smax) // 10)):
        x, _ = xy(s, lmin)
        line(x, h - m, x, h - m + 5, (0, 0, 0))
    for f in rep["faults"]:
        if f["ok"] and f["step"] >= 0:
            x, _ = xy(f["step"], lmin)
            line(x, m, x, h - m, (214, 39, 40), 2)
    for a, b in zip(ref, ref[1:], strict=False):
        line(*xy(*a), *xy(*b), (160, 160, 160), 3)
    for a, b in zip(chaos, chaos[1:], strict=False):
        if a[3] == b[3]:
            line(*xy(a[0], a[1]), *xy(b[0], b[1]), _COLORS[a[3] % len(_COLORS)], 2)
    for s, lo, _t, att in chaos:
        x, y = xy(s, lo)
        for dx in (-2, -1, 0, 1, 2):
            for dy in (-2, -1, 0, 1, 2):
                put(x + dx, y + dy, _COLORS[att % len(_COLORS)])
    path.write_bytes(_png_bytes(px, w, h))


def write_png(rep: dict[str, Any], path: str | Path) -> None:
    path = Path(path)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _raster_plot(rep, path)
        return
    fig, ax = plt.subplots(figsize=(9, 5))
    ref = rep["curves"]["reference"]
    if ref:
        ax.plot([s for s, _ in ref], [lo for _, lo in ref], color="0.6", lw=3,
                label="reference")
    by_attempt: dict[int, list[list[Any]]] = {}
    for row in rep["curves"]["chaos"]:
        by_attempt.setdefault(row[3], []).append(row)
    for att, rows in sorted(by_attempt.items()):
        ax.plot([r[0] for r in rows], [r[1] for r in rows], marker=".", lw=1.2,
                label=f"attempt {att}")
    for f in rep["faults"]:
        if f["ok"] and f["step"] >= 0:
            ax.axvline(f["step"], color="tab:red", ls="--", lw=1)
            ax.text(f["step"], ax.get_ylim()[1], f" {f['kind']}", rotation=90, va="top",
                    fontsize=7, color="tab:red")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"{rep['scenario']} seed {rep['seed']}: "
                 f"{'passed' if rep['passed'] else 'FAILED'}")
    if ax.get_legend_handles_labels()[0]:  # a run that logged no step has no curve
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(out_dir: str | Path, rep: dict[str, Any]) -> dict[str, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "report.json", "markdown": out / "report.md", "png": out / "loss.png"}
    paths["json"].write_text(json.dumps(rep, indent=2, default=str) + "\n")
    try:
        write_png(rep, paths["png"])
        png_name: str | None = paths["png"].name
    except Exception:  # noqa: BLE001 - a plot failure must not hide the verdict
        logger.exception("could not draw %s", paths["png"])
        png_name = None
    paths["markdown"].write_text(render_markdown(rep, png_name))
    return paths


def write_junit(path: str | Path, rep: dict[str, Any]) -> None:
    """One test suite per scenario run, one test case per invariant."""
    invs = rep["invariants"]
    failures = sum(1 for i in invs if not i["ok"])
    suite = ET.Element(
        "testsuite",
        name=f"chaos.{rep['scenario']}",
        tests=str(len(invs)),
        failures=str(failures),
        errors="0",
        time=f"{rep['wall_s']:.3f}",
    )
    props = ET.SubElement(suite, "properties")
    ET.SubElement(props, "property", name="seed", value=str(rep["seed"]))
    ET.SubElement(props, "property", name="goodput", value=str(rep["goodput"]["goodput"]))
    for inv in invs:
        case = ET.SubElement(
            suite, "testcase", classname=f"chaos.{rep['scenario']}.seed{rep['seed']}",
            name=f"invariant_{inv['number']}_{inv['name'].replace(' ', '_')}",
        )
        if not inv["ok"]:
            fail = ET.SubElement(case, "failure", message=inv["summary"][:500])
            fail.text = "\n".join(inv["details"])
        else:
            out = ET.SubElement(case, "system-out")
            out.text = f"{inv['summary']} (tolerance: {inv['tolerance'] or '-'})"
    tree = ET.ElementTree(suite)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tree.write(path, encoding="utf-8", xml_declaration=True)
