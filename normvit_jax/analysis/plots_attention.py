"""Figures of attention: maps over the input image, token-to-token matrices, mean distance."""
from __future__ import annotations

from typing import Sequence

import numpy as np
from matplotlib.figure import Figure

from normvit_jax.analysis import figures

CMAP = "inferno"
MAP_NOTE = "colour: attention of the class token to each patch, scaled to the panel's maximum"
STAR_NOTE = "; * block without a class token: mean attention each patch receives"


def overlay_grid(base: Sequence[np.ndarray], maps: Sequence[Sequence[np.ndarray]],
                 row_labels: Sequence[str], col_labels: Sequence[str], title: str,
                 note: str | None = None) -> Figure:
    """Rows: base[r] (S, S, 3) in [0, 1] then maps[r][c] (gh, gw) over it, each scaled to its max."""
    rows, cols = len(base), 1 + len(col_labels)
    cell = 1.55
    fig = figures.figure(cell * cols + 0.9, cell * rows + 0.9)
    axes = fig.subplots(rows, cols, squeeze=False)
    im = None
    for r in range(rows):
        img = base[r]
        s = img.shape[0]
        axes[r, 0].imshow(img, interpolation="nearest")
        axes[r, 0].set_ylabel(row_labels[r], fontsize=8)
        for c in range(1, cols):
            m = np.asarray(maps[r][c - 1], np.float64)
            axes[r, c].imshow(img.mean(-1), cmap="gray", interpolation="nearest", vmin=0, vmax=1)
            im = axes[r, c].imshow(m / max(m.max(), 1e-12), cmap=CMAP, alpha=0.65, vmin=0, vmax=1,
                                   extent=(-0.5, s - 0.5, s - 0.5, -0.5), interpolation="nearest")
        for ax in axes[r]:
            ax.set_xticks([])
            ax.set_yticks([])
    axes[0, 0].set_title("input", fontsize=9)
    for c, text in enumerate(col_labels, start=1):
        axes[0, c].set_title(text, fontsize=9)
    if im is not None:
        fig.colorbar(im, ax=axes[:, -1].tolist(), shrink=0.6, label="attention / panel max")
    figures.suptitle(fig, title, fontsize=10)
    # the '*' is explained only where a column has one (it was explained on every figure)
    figures.note(fig, note if note is not None else
                 MAP_NOTE + (STAR_NOTE if any(t.endswith("*") for t in col_labels) else ""))
    return fig


def matrix_figure(matrices: Sequence[np.ndarray], heads: Sequence[int], prefix: int,
                  title: str) -> Figure:
    """One (T, T) attention matrix per head (rows: queries, columns: keys)."""
    n = len(matrices)
    fig = figures.figure(3.1 * n + 0.4, 3.3)
    axes = fig.subplots(1, n, squeeze=False)[0]
    for ax, m, h in zip(axes, matrices, heads):
        im = ax.imshow(m, cmap="viridis", interpolation="nearest", vmin=0)
        ax.set_title(f"head {h}", fontsize=9)
        ax.set_xlabel("key token", fontsize=8)
        ax.set_ylabel("query token", fontsize=8)
        n = m.shape[0] - prefix
        step = max(1, n // 4)
        ticks = [prefix + k for k in range(step if prefix else 0, n, step)]
        names = [f"p{k - prefix}" for k in ticks]
        if prefix:
            ticks, names = [0] + ticks, ["CLS"] + names
        ax.set_xticks(ticks, names, fontsize=7)
        ax.set_yticks(ticks, names, fontsize=7)
        fig.colorbar(im, ax=ax, shrink=0.8, label="attention weight")
    figures.suptitle(fig, title, fontsize=10)
    figures.note(fig, "p<k>: patch k of the row-major patch grid" + ("; CLS: the class token" if prefix else ""))
    return fig


def distance_figure(runs: Sequence[tuple[str, tuple, np.ndarray]], uniform_px: float | None,
                    title: str) -> Figure:
    """Scatter of the mean attention distance (pixels) of every head against the block.

    runs: (label, colour, distances (depth, H) averaged over images).
    """
    fig = figures.figure(8.2, 4.0)
    ax = fig.subplots()
    k = len(runs)
    style = figures.styles([r[1] for r in runs])
    for i, ((lab, col, dist), (ls, mk)) in enumerate(zip(runs, style)):
        depth, heads = dist.shape
        off = (i - (k - 1) / 2) * min(0.5 / max(k, 1), 0.15)
        x = np.repeat(np.arange(depth), heads) + off
        ax.scatter(x, dist.reshape(-1), s=22, color=col, alpha=0.85, label=lab, marker=mk,
                   edgecolors="white", linewidths=0.4)
        ax.plot(np.arange(depth) + off, dist.mean(1), color=col, lw=1, alpha=0.6, ls=ls)
    if uniform_px is not None:
        ax.axhline(uniform_px, color="gray", ls="--", lw=1,
                   label=f"uniform attention ({uniform_px:.1f} px)")
    depth = max(d.shape[0] for _, _, d in runs)
    ax.set_xticks(range(depth))
    ax.set_xlabel("block (network depth)")
    ax.set_ylabel("mean attention distance (pixels)")
    top = max([float(d.max()) for _, _, d in runs] + [uniform_px or 0.0])
    ax.set_ylim(0, 1.12 * top if top > 0 else 1.0)
    ax.grid(alpha=0.3)
    figures.legend(fig, [ax], [r[0] for r in runs])
    ax.set_title(figures.wrap(fig, title, 10, width=ax.get_position().width * fig.get_figwidth()),
                 fontsize=10)
    figures.note(fig, "one dot per head, averaged over images; line: mean over heads; distance "
                      "between the query patch and the key patches, in input pixels")
    return fig
