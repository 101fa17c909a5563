"""Training curves of several runs on shared axes: against steps or against wall time."""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
from matplotlib import ticker
from matplotlib.figure import Figure

from normvit_jax.analysis import figures
from normvit_jax.summaries import Series

PANELS = (("train/loss", "train loss", "cross-entropy", 1.0),
          ("eval/loss", "eval loss", "cross-entropy", 1.0),
          ("eval/top1", "eval top-1 accuracy", "top-1 accuracy (%)", 100.0))


def panels(label_smoothing: Sequence[float]) -> tuple[tuple[str, str, str, float], ...]:
    """PANELS with the train loss named as the runs trained it: with ``config.label_smoothing``
    > 0 it is the label-smoothed objective (at 0.1 it stays above ~0.5 on 10 classes), which the
    eval panel's plain cross-entropy is not; several values are listed ('ε=0/0.1')."""
    eps = sorted({float(e or 0) for e in label_smoothing})
    if not any(eps):
        return PANELS
    unit = f"label-smoothed cross-entropy (ε={'/'.join(f'{e:g}' for e in eps)})"
    return ((PANELS[0][0], "train loss (training objective)", unit, 1.0),
            (PANELS[1][0], "eval loss", "cross-entropy (no smoothing)", 1.0), PANELS[2])
# elapsed runs from the run's first event (written before the train step compiles), so it holds
# the compilation; only the process's Python/JAX start-up comes before it
AXES = {"step": "training step",
        "elapsed": "wall time since the run's first event ({unit}; compilation included, "
                   "restarts' idle gaps removed)"}
FEW_POINTS = 3  # a series with this many points or fewer gets markers: one point drew nothing


def needs_markers(tag: str, points: int) -> bool:
    """Markers on eval series (few, spaced points) and on any series with FEW_POINTS or fewer
    (a single point drawn as a line without markers is invisible, an empty tags.png panel)."""
    return tag.startswith("eval/") or points <= FEW_POINTS


def time_unit(seconds: float) -> tuple[str, float]:
    """(unit, divisor) for a wall-time axis spanning ``seconds``: a short run in fractions of a
    minute, a long one in thousands of minutes, were hard to read."""
    if seconds < 120:
        return "seconds", 1.0
    if seconds < 3 * 3600:
        return "minutes", 60.0
    return "hours", 3600.0


def curves_figure(runs: Sequence[tuple[str, tuple, Mapping[str, Series]]], x: str,
                  title: str, tags: Sequence[tuple[str, str, str, float]] = PANELS) -> Figure:
    """runs: (label, colour, scalars). x: 'step' or 'elapsed'. One panel per tag."""
    fig = figures.figure(4.3 * len(tags) + 2.0, 3.7)
    axes = fig.subplots(1, len(tags), squeeze=False)[0]
    style = figures.styles([r[1] for r in runs])
    span = max((float(np.max(s.elapsed)) for _, _, sc in runs for t, *_ in tags
                if (s := sc.get(t)) is not None and len(s.steps)), default=0.0)
    time_name, div = time_unit(span)
    for ax, (tag, name, unit, factor) in zip(axes, tags):
        for (lab, col, scalars), (ls, mk) in zip(runs, style):
            s = scalars.get(tag)
            if s is None or not len(s.steps):
                continue
            xs = s.steps if x == "step" else s.elapsed / div
            marker = mk if needs_markers(tag, len(s.steps)) else None
            ax.plot(xs, s.values * factor, color=col, label=lab, marker=marker, ms=3, lw=1.3,
                    ls=ls)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel(AXES[x].format(unit=time_name), fontsize=8)
        if x == "step":  # one eval step got ticks 190.0, 192.5, ...
            ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
        ax.set_ylabel(unit, fontsize=8)
        ax.grid(alpha=0.3)
    figures.legend(fig, axes, [r[0] for r in runs])
    figures.suptitle(fig, title, fontsize=10)
    return fig
