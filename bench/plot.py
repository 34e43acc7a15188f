"""Plotting helpers shared by the bench scripts; matplotlib is optional (the `bench` extra)."""

from __future__ import annotations

import sys
from pathlib import Path


def pyplot():
    """matplotlib.pyplot with a file-only backend, or None (with a message) if not installed."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed (pip install matplotlib): no plot", file=sys.stderr)
        return None
    matplotlib.use("Agg")  # no display on CI machines or servers
    import matplotlib.pyplot as plt

    return plt


def lines(ax, series: dict[str, tuple[list, list]], *, xlabel: str, ylabel: str, title: str):
    """One marked line per name: series {name: (xs, ys)}; a log2 x axis ticked at the xs."""
    for name, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", label=name)
    ticks = sorted({x for xs, _ in series.values() for x in xs})
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()


def save(fig, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}", file=sys.stderr)
