"""The convergence figure: each method's mean eval top-1 over its runs against steps, the min-max
band over the runs, the target line and where each method reaches it."""
from __future__ import annotations

from typing import Any, Mapping

from matplotlib import ticker
from matplotlib.figure import Figure

from normvit_jax.analysis import colors, figures
from normvit_jax.analysis.convergence import Convergence, reach_cell


def triangle_positions(conv: Convergence) -> list[tuple[str, float, float]]:
    """(method, step, top-1 %) of each method's reaching triangle: on the target line, and for
    methods reaching it at the same step (within 1% of the x range) stacked upwards by a
    triangle's height each, as they hid each other."""
    reached = [c for c in conv.methods if c.reach_mean is not None]
    if not reached:
        return []
    values = [100 * v for c in conv.methods for v in (*c.low, *c.high)] + [100 * conv.threshold]
    steps = [s for c in conv.methods for s in c.steps]
    dy = 0.04 * max(max(values) - min(values), 1.0)
    dx = 0.01 * max(max(steps) - min(steps), 1.0) if steps else 1.0
    out: list[tuple[str, float, float]] = []
    for c in reached:
        k = sum(abs(x - c.reach_mean) <= dx for _, x, _ in out)
        out.append((c.method, c.reach_mean, 100 * conv.threshold + k * dy))
    return out


def convergence_figure(conv: Convergence, title: str,
                       palette: Mapping[str, Any] | None = None) -> Figure:
    """palette: method -> colour (the report's ``colors.palette``, one per method; None: each
    method's ``colors.color``)."""
    pal = palette or colors.palette([c.method for c in conv.methods])
    fig = figures.figure(10.0, 5.0)
    ax = fig.subplots()
    for c in conv.methods:
        col = pal[c.method]
        ax.fill_between(c.steps, 100 * c.low, 100 * c.high, color=col, alpha=0.15, lw=0)
        ax.plot(c.steps, 100 * c.mean, color=col, lw=1.4, marker="o", ms=2.5,
                label=f"{c.label} (n={len(c.workdirs)}; target "
                      + (f"at step {reach_cell(c)})" if c.reach_mean is not None
                         else f"{reach_cell(c)})"))
    for method, x, y in triangle_positions(conv):  # at the mean over the runs
        ax.plot([x], [y], marker="v", ms=9, color=pal[method],
                markeredgecolor="black", markeredgewidth=0.6, zorder=5)
    ax.axhline(100 * conv.threshold, color="black", ls=":", lw=1.2,
               label=f"{100 * conv.target:g}% of {conv.reference_label}'s final "
                     f"({100 * conv.threshold:.1f}%)")
    ax.set_xlabel("training step", fontsize=9)
    ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))  # one eval: not 192.5
    ax.set_ylabel("eval top-1 accuracy (%)", fontsize=9)
    ax.grid(alpha=0.3)
    # right of the axes: inside (lower right) it hid the curve of a method that stays low
    figures.legend(fig, [ax], fontsize=7.5)
    # over the axes alone: a figure-wide title ran under the legend at the upper right
    # the axes' width before the legend is placed would be the figure's: measure after a draw
    fig.canvas.draw()
    ax.set_title(figures.wrap(fig, title, 10, width=ax.get_position().width * fig.get_figwidth()),
                 fontsize=10)
    figures.note(fig, "Line: mean over a method's runs at the steps all of them evaluated; band: "
                      "min-max over the runs; triangle: the mean over the runs of the first "
                      "evaluated step at or above the dotted target, each run's step in the "
                      "legend where they differ (none when a run never gets "
                      "there; methods at the same step stacked above the line).")
    return fig
