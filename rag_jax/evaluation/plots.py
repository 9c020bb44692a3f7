"""Line plots of evaluation results (PNG), shared by the demo report and the long-context evaluations.

matplotlib is imported when a plot is drawn (it is slow to import and only reports need it)."""
from __future__ import annotations

from pathlib import Path


def line_plot(path: Path, series: list[tuple[list, list, str]], *, xlabel: str, ylabel: str, title: str,
              style: str = "-", size=(7, 4), ylim: tuple[float, float] | None = None, logx: bool = False) -> str:
    """Write a PNG of ``(x, y, label)`` lines to ``path`` (``logx``: base-2 log x axis, ticks at the data);
    returns the path (no pyplot: no global backend state, works in notebooks and threads)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=size)
    ax = fig.add_subplot()
    for x, y, label in series:
        ax.plot(x, y, style, label=label)
    if logx:
        ticks = sorted({v for x, _, _ in series for v in x})
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [f"{v:,}" for v in ticks])
    if ylim is not None:
        ax.set_ylim(*ylim)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return str(path)
