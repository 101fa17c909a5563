"""Matplotlib figures without pyplot (Agg canvas: no display, no global state, thread-safe)."""
from __future__ import annotations

import os
import textwrap

import numpy as np
from matplotlib import ticker
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

DPI = 80


def figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def save(fig: Figure, path: str, dpi: int = DPI) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=dpi)
    return path


def to_uint8(fig: Figure, dpi: int = DPI) -> np.ndarray:
    """(H, W, 3) uint8 rendering, for TensorBoard images."""
    fig.set_dpi(dpi)
    fig.canvas.draw()
    return np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()


def wrap(fig: Figure, text: str, fontsize: float, width: float | None = None) -> str:
    """``text`` wrapped to ``width`` inches (default: the figure's), so a long title on a narrow
    figure (one attention head) is not cut at both edges."""
    chars = max(int(((width or fig.get_figwidth()) - 0.3) * 72 / (0.6 * fontsize)), 12)
    return "\n".join(textwrap.fill(part, chars) for part in text.split("\n"))


def suptitle(fig: Figure, text: str, fontsize: float = 10) -> None:
    fig.suptitle(wrap(fig, text, fontsize), fontsize=fontsize)


def note(fig: Figure, text: str, fontsize: int = 7) -> None:
    """A footnote under the axes, wrapped to the figure's width."""
    chars = int((fig.get_figwidth() - 0.3) * 72 / (0.62 * fontsize))
    fig.supxlabel(textwrap.fill(text, chars), fontsize=fontsize)


def log_y(ax: Axes) -> None:
    """Log y axis with plain numbers (0.5, 2, 30) instead of powers of ten."""
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:.3g}"))
    # Narrow ranges have at most one major tick: label the minor ones then.
    ax.yaxis.set_minor_formatter(ticker.FuncFormatter(
        lambda v, _: f"{v:.3g}" if ax.get_ylim()[1] / ax.get_ylim()[0] < 2.2 else ""))


def legend(fig: Figure, axes, order: list[str] | None = None, fontsize: int = 8) -> None:
    """One legend for the figure, right of the axes: each label once, in ``order`` (the runs'
    order) where given, then in order of appearance."""
    seen: dict[str, object] = {}
    for ax in np.ravel(axes):
        for h, lab in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(lab, h)
    rank = {lab: i for i, lab in enumerate(order or [])}
    labels = sorted(seen, key=lambda lab: rank.get(lab, len(rank)))
    if labels:
        fig.legend([seen[lab] for lab in labels], labels, loc="outside right upper",
                   fontsize=fontsize)
