"""Loss curves as PNG files, for train.py's loss.png and the ablation's figures alike.

matplotlib is optional: without it plot_curves draws nothing and returns None, and the
callers print their numbers as a table instead.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from ..support.files import atomic_write


@dataclass
class Curve:
    label: str
    x: Sequence[float]
    y: Sequence[float]
    low: Optional[Sequence[float]] = None  # with high: a shaded band (the spread over seeds)
    high: Optional[Sequence[float]] = None
    style: str = "-"
    faint: bool = False  # a thin, pale line: a noisy series drawn behind the others


def plot_curves(path: Path, curves: list, xlabel: str, ylabel: str, title: str) -> Optional[Path]:
    """One figure of curves on a log-scaled loss axis, saved to path; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for curve in curves:
        look = dict(lw=0.8, alpha=0.6) if curve.faint else {}
        ax.plot(curve.x, curve.y, curve.style, label=curve.label, **look)
        if curve.low is not None:
            ax.fill_between(curve.x, curve.low, curve.high, alpha=0.2)
    # A log scale shows the untrained start, a lagging curve and the small gaps near the end at once.
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=100))
    plt.close(fig)
    return path
