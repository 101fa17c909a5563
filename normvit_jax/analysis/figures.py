"""Matplotlib figures without pyplot (Agg canvas: no display, no global state, thread-safe)."""
from __future__ import annotations

import io
import math
import textwrap
from typing import Any

import matplotlib
import numpy as np
from etils import epath
from matplotlib import ticker
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

DPI = 80
LEGEND_CHARS = 40  # a legend label's longest line


def plain_text() -> Any:
    """A context in which text is drawn as it is: a class or folder name such as '$\\alpha$' or
    'price $5 $6' was parsed as TeX math (a ValueError at savefig, or the wrong text)."""
    return matplotlib.rc_context({"text.parse_math": False})


def figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def save(fig: Figure, path: Any, dpi: int = DPI) -> str:
    """Writes ``fig`` to ``path`` (local or gs://; the format from its suffix) through a
    temporary file renamed into place: never a half picture under the final name."""
    path = epath.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = io.BytesIO()
    fig.savefig(data, dpi=dpi, format=path.suffix.lstrip(".") or "png")
    tmp = path.parent / (path.name + ".tmp")
    tmp.write_bytes(data.getvalue())
    tmp.replace(path)
    return str(path)


def to_uint8(fig: Figure, dpi: int = DPI) -> np.ndarray:
    """(H, W, 3) uint8 rendering, for TensorBoard images."""
    fig.set_dpi(dpi)
    fig.canvas.draw()
    return np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()


def wrap(fig: Figure, text: str, fontsize: float, width: float | None = None) -> str:
    """``text`` wrapped to ``width`` inches (default: the figure's), so a long title on a narrow
    figure (one attention head) is not cut at both edges."""
    chars = max(int(((width or fig.get_figwidth()) - 0.3) * 72 / (0.6 * fontsize)), 12)
    # at spaces only: a hyphenated name ('ViT-custom', 'LN->RepBN') was split at its hyphen
    return "\n".join(textwrap.fill(part, chars, break_on_hyphens=False, break_long_words=False)
                     for part in text.split("\n"))


def suptitle(fig: Figure, text: str, fontsize: float = 10) -> None:
    fig.suptitle(wrap(fig, text, fontsize), fontsize=fontsize)


def note(fig: Figure, text: str, fontsize: int = 7) -> None:
    """A footnote under the axes, wrapped to the figure's width."""
    chars = int((fig.get_figwidth() - 0.3) * 72 / (0.62 * fontsize))
    fig.supxlabel(textwrap.fill(text, chars), fontsize=fontsize)


class LabelledLogLocator(ticker.Locator):
    """Major ticks of a log axis such that at least three fall in view: powers of ten where the
    range spans decades, then 1-2-5, then every integer multiple, and for a range narrower than
    that (e.g. 1.5 to 1.9) evenly spaced plain numbers; a log axis with one or two labels cannot
    be read."""

    def __call__(self):
        return self.tick_values(*self.axis.get_view_interval())

    def tick_values(self, vmin: float, vmax: float) -> list[float]:
        lo, hi = sorted((vmin, vmax))
        if not lo > 0:
            return []
        low, high = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
        stride = max(1, math.ceil((high - low + 1) / 9))  # every k-th decade when many
        for subs in ((1,), (1, 2, 5), tuple(range(1, 10))):
            ticks = [m * 10.0 ** e for e in range(low, high + 1, stride if subs == (1,) else 1)
                     for m in subs if lo <= m * 10.0 ** e <= hi]
            if 3 <= len(ticks) <= 9:
                return ticks
        # narrower than 1..9 x 10^k: a 1-2-5 step giving 3 to 6 plain numbers
        exponent = math.floor(math.log10(hi - lo)) - 1 if hi > lo else low
        for step in (m * 10.0 ** e for e in (exponent, exponent + 1) for m in (1, 2, 5)):
            ticks = [k * step for k in range(math.ceil(lo / step), math.floor(hi / step) + 1)]
            if 3 <= len(ticks) <= 6:
                return ticks
        return [lo, hi]


def log_y(ax: Axes) -> None:
    """Log y axis with plain numbers (0.5, 2, 30) instead of powers of ten, at least three of
    them labelled whatever the range."""
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LabelledLogLocator())
    ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:.4g}"))
    ax.yaxis.set_minor_formatter(ticker.NullFormatter())


STYLES = (("-", "o"), ("--", "s"), (":", "^"), ("-.", "D"), ((0, (5, 1, 1, 1)), "v"))


def styles(colours: list) -> list[tuple[object, str]]:
    """(linestyle, marker) of each run: the k-th run sharing a colour (one method, several
    seeds) gets the k-th style, so runs of one method can be told apart (they were drawn
    identically, the legend naming each run against indistinguishable lines)."""
    seen: dict[str, int] = {}
    out = []
    for c in colours:
        k = seen[str(c)] = seen.get(str(c), -1) + 1
        out.append(STYLES[k % len(STYLES)])
    return out


def legend(fig: Figure, axes: Any, order: list[str] | None = None, fontsize: float = 8) -> None:
    """One legend for the figure, right of the axes: each label once, in ``order`` (the runs'
    order) where given, then in order of appearance."""
    seen: dict[str, object] = {}
    for ax in np.ravel(axes):
        for h, lab in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(lab, h)
    rank = {lab: i for i, lab in enumerate(order or [])}
    labels = sorted(seen, key=lambda lab: rank.get(lab, len(rank)))
    if labels:
        # a long run name on one line made the legend wider than the axes, squeezing the panels
        # to slivers and pushing the title off the canvas; wrapped, every character is kept
        shown = [textwrap.fill(lab, LEGEND_CHARS, break_on_hyphens=False) for lab in labels]
        fig.legend([seen[lab] for lab in labels], shown, loc="outside right upper",
                   fontsize=fontsize)
