"""Figures of token statistics per norm slot (before/after the norm) and of the norms' gates."""
from __future__ import annotations

import re
from typing import Mapping, Sequence

import numpy as np
from matplotlib.figure import Figure

from normvit_jax.analysis import figures
from normvit_jax.models.spec import BLOCK_SLOTS, FINAL_SLOT

# along a block: the attention norm, its post-norm (sandwich), the MLP norm, its post-norm
_OFFSETS = dict(zip((BLOCK_SLOTS[0], BLOCK_SLOTS[2], BLOCK_SLOTS[1], BLOCK_SLOTS[3]),
                    (0.0, 0.25, 0.5, 0.75)))
STATS = (("chan_mean", "mean", False), ("chan_var", "variance across channels\n(per token)", True),
         ("tok_var", "variance across tokens\n(per channel)", True), ("max_abs", "max |x|", True))
X_NOTE = ("x: norm slot position: block k's first norm (LayerNorm_0) at k, its second "
          "(LayerNorm_2) at k+0.5, the final norm at the end")


def slot_position(path: str, depth: int) -> float | None:
    """Where a slot sits along the depth; None for slots outside the blocks (patch norms)."""
    if path == FINAL_SLOT:
        return float(depth)
    m = re.match(r"^encoderblock_(\d+)/(\w+)$", path)
    if not m or m.group(2) not in _OFFSETS:
        return None
    return int(m.group(1)) + _OFFSETS[m.group(2)]


def _xaxis(ax, depth: int) -> None:
    ticks = list(range(depth)) + [depth]
    ax.set_xticks(ticks, [str(t) for t in range(depth)] + ["final"], fontsize=8)
    ax.grid(alpha=0.3)


def token_stats_figure(runs: Sequence[tuple[str, tuple, Mapping[str, Mapping]]], depth: int,
                       title: str) -> Figure:
    """runs: (label, colour, stats: slot -> {'in'|'out': {stat: value}}). Rows: before/after."""
    fig = figures.figure(14.0, 5.6)
    axes = fig.subplots(2, len(STATS), squeeze=False)
    style = figures.styles([r[1] for r in runs])
    for r, side in enumerate(("in", "out")):
        for c, (key, name, log) in enumerate(STATS):
            ax = axes[r, c]
            for (lab, col, stats), (ls, mk) in zip(runs, style):
                pts = sorted((slot_position(s, depth), d[side][key]) for s, d in stats.items()
                             if side in d and slot_position(s, depth) is not None)
                if pts:
                    x, y = zip(*pts)
                    ax.plot(x, y, color=col, label=lab, ms=3.5, lw=1.2, ls=ls, marker=mk)
            if log:
                figures.log_y(ax)
            ax.set_title(f"{name}, {'before' if side == 'in' else 'after'} the norm", fontsize=9)
            _xaxis(ax, depth)
            if r == 1:
                ax.set_xlabel("block", fontsize=8)
    figures.legend(fig, axes, [r[0] for r in runs])
    figures.suptitle(fig, title, fontsize=10)
    figures.note(fig, X_NOTE + "; statistics averaged over the images")
    return fig


# The y axis of each kind's panel (the panels had none).
GATE_UNITS = {"lambda_var": "sigmoid(gate) λ", "lambda_mean": "sigmoid(gate) λ",
              "skip_rate": "fraction of steps", "scale_abs_mean": "mean |γ|", "g_abs_mean": "|g|",
              "rescale_s": "s", "alpha": "α", "shift": "shift", "eta": "η"}
GATE_KINDS = (
    ("lambda_var", "DTN gate λ (variance) per head\n1: LN statistics, 0: position-aware IN"),
    ("lambda_mean", "DTN gate λ (mean) per head\n1: LN statistics, 0: position-aware IN"),
    ("skip_rate", "UN skip rate\n(outlier-filtered steps / steps)"),
    ("scale_abs_mean", "mean |scale| of the norm's affine γ\n(LearnableScaler: its scaler; "
                       "RepBN: its BN's)"),
    ("g_abs_mean", "ScaleNorm |g|"),
    ("rescale_s", "RescaleViT residual factor s"),
    ("alpha", "DyT / DeRF input scale α"),
    ("shift", "DeRF shift s"),
    ("eta", "RepBN identity weight η"),
)


def gate_kinds(runs: Sequence[tuple[str, tuple, Mapping[str, Mapping[str, float]]]]) -> list:
    present = {re.sub(r"_h\d+$", "", g) for _, _, gates in runs for d in gates.values() for g in d}
    return [(k, t) for k, t in GATE_KINDS if k in present]


def _gate_position(slot: str, depth: int) -> float | None:
    """A norm slot's position; a block's own gate (rescale_s, on the MLP residual) at k + 0.5."""
    m = re.match(r"^encoderblock_(\d+)$", slot)
    return int(m.group(1)) + 0.5 if m else slot_position(slot, depth)


def gates_figure(runs: Sequence[tuple[str, tuple, Mapping[str, Mapping[str, float]]]], depth: int,
                 title: str) -> Figure:
    """runs: (label, colour, gates: slot -> {gate: value}); one panel per kind of gate present."""
    kinds = gate_kinds(runs)
    ncols = min(3, max(len(kinds), 1))
    nrows = -(-max(len(kinds), 1) // ncols)
    fig = figures.figure(4.0 * ncols + 2.2, 3.3 * nrows + 0.5)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax in axes[len(kinds):]:
        ax.set_visible(False)
    style = figures.styles([r[1] for r in runs])
    for ax, (kind, name) in zip(axes, kinds):
        for (lab, col, gates), (_, mk) in zip(runs, style):
            xs, ys = [], []
            for slot, d in gates.items():
                x = _gate_position(slot, depth)
                if x is None:
                    continue
                for g, v in d.items():
                    if re.sub(r"_h\d+$", "", g) == kind:
                        xs.append(x)
                        ys.append(v)
            if xs:
                order = np.argsort(xs, kind="stable")
                ax.plot(np.asarray(xs)[order], np.asarray(ys)[order], mk, color=col, label=lab,
                        ms=4, alpha=0.85)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("block", fontsize=8)
        ax.set_ylabel(GATE_UNITS.get(kind, kind), fontsize=8)
        _xaxis(ax, depth)
        if kind.startswith("lambda"):
            ax.set_ylim(-0.03, 1.03)
        elif kind == "skip_rate":
            ax.set_ylim(-0.005, max(0.05, 1.15 * ax.get_ylim()[1]))
        else:
            ax.ticklabel_format(axis="y", useOffset=False)
    figures.legend(fig, axes[:len(kinds)], [r[0] for r in runs])
    figures.suptitle(fig, title, fontsize=10)
    figures.note(fig, X_NOTE)
    return fig
