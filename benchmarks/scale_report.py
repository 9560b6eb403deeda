"""Tables, growth exponents and log-log plots of the scale benchmark's figures."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

__all__ = ["growth_exponent", "Series", "plot", "fmt"]

Series = tuple[str, Sequence[float], Sequence[float | None]]
"""(label, x values, y values; None where not measured)."""


def growth_exponent(xs: Sequence[float], ys: Sequence[float | None]) -> float | None:
    """Least-squares slope of log y over log x: y ~ x^k. None with fewer than 2 points."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys, strict=True)
           if y is not None and y > 0 and x > 0]
    if len(pts) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    var = sum((p[0] - mx) ** 2 for p in pts)
    if var == 0:
        return None
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / var


def fmt(v: float | None, unit: str = "s") -> str:
    if v is None:
        return "-"
    if unit == "s":
        return f"{v * 1000:.1f} ms" if v < 1 else f"{v:.2f} s"
    if unit == "B":
        for u, d in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
            if v >= d:
                return f"{v / d:.2f} {u}"
        return f"{v:.0f} B"
    if unit == "MiB":
        return f"{v:.0f} MiB"
    return f"{v:.3g}"


def plot(path: Path, title: str, xlabel: str, ylabel: str, series: list[Series],
         target: float | None = None) -> None:
    """One log-log PNG; each series labelled with its fitted exponent."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=100)
    for label, xs, ys in series:
        pts = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None and y > 0]
        if not pts:
            continue
        k = growth_exponent(xs, ys)
        name = f"{label} (~N^{k:.2f})" if k is not None else label
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    if target is not None:
        ax.axhline(target, color="grey", linestyle="--", linewidth=1, label="target")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
