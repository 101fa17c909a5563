"""Training curves of several runs on shared axes: against steps or against wall time."""
from __future__ import annotations

from typing import Mapping, Sequence

from matplotlib.figure import Figure

from normvit_jax.analysis import figures
from normvit_jax.summaries import Series

PANELS = (("train/loss", "train loss", "cross-entropy", 1.0),
          ("eval/loss", "eval loss", "cross-entropy", 1.0),
          ("eval/top1", "eval top-1 accuracy", "top-1 accuracy (%)", 100.0))
AXES = {"step": "training step", "elapsed": "wall time (minutes, restarts' idle gaps removed)"}


def curves_figure(runs: Sequence[tuple[str, tuple, Mapping[str, Series]]], x: str,
                  title: str, tags: Sequence[tuple[str, str, str, float]] = PANELS) -> Figure:
    """runs: (label, colour, scalars). x: 'step' or 'elapsed'. One panel per tag."""
    fig = figures.figure(4.3 * len(tags) + 2.0, 3.7)
    axes = fig.subplots(1, len(tags), squeeze=False)[0]
    style = figures.styles([r[1] for r in runs])
    for ax, (tag, name, unit, factor) in zip(axes, tags):
        for (lab, col, scalars), (ls, mk) in zip(runs, style):
            s = scalars.get(tag)
            if s is None or not len(s.steps):
                continue
            xs = s.steps if x == "step" else s.elapsed / 60.0
            marker = mk if tag.startswith("eval/") else None
            ax.plot(xs, s.values * factor, color=col, label=lab, marker=marker, ms=3, lw=1.3,
                    ls=ls)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel(AXES[x], fontsize=8)
        ax.set_ylabel(unit, fontsize=8)
        ax.grid(alpha=0.3)
    figures.legend(fig, axes, [r[0] for r in runs])
    figures.suptitle(fig, title, fontsize=10)
    return fig
