"""Attention maps, attention distances, token statistics and norm gates of one trained run.

    python -m normvit_jax.analysis.attention --workdir=runs/dtn --images=8 --out=report/dtn

Writes to --out:
  attention_maps_head{h}.png     per chosen head: rows = images, columns = chosen blocks; the class
                                 token's attention to the patch grid over the input image
  attention_matrix_block{b}.png  per chosen block: the token-to-token matrix of each chosen head,
                                 averaged over the --images images
  attention_distance.png/.csv    mean attention distance of every head of every block
  token_stats.png/.csv           per norm slot, before and after the norm
  norm_gates.png/.csv            the norms' learned gates (DTN lambda, UN skip rate, scales)
Distances and statistics are averaged over --stat_images eval images (one batch). --images is
at most MAX_IMAGES: each image is a row of the maps figure (--images=400 drew a 44,092-pixel-tall
PNG for ten minutes); more is refused (exit 2, one line).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Mapping, Sequence

import numpy as np

from normvit_jax import tool_flags
from normvit_jax.analysis import (capture, colors, distance, figures, gates, plots_attention,
                                  plots_stats, tables)


MAX_IMAGES = 32  # rows of attention_maps_head{h}.png (~4,000 pixels tall)


def map_images(text: str) -> int:
    """An argparse ``type`` for --images: 1..MAX_IMAGES (one figure row each)."""
    value = tool_flags.positive_int(text)
    if value > MAX_IMAGES:
        raise argparse.ArgumentTypeError(
            f"{value} is not accepted; accepted: an integer in 1..{MAX_IMAGES} (each is a row of "
            f"attention_maps_head{{h}}.png; --stat_images averages the distances and statistics "
            f"over more)")
    return value


def default_blocks(depth: int) -> list[int]:
    """Up to four blocks, evenly spaced from the first: 0/3/6/9 of 12, every block of <= 4."""
    return list(range(0, depth, max(1, depth // 4)))[:4]


def parse_indices(spec: str, n: int, default: Sequence[int]) -> list[int]:
    """'auto' -> default, 'all' -> 0..n-1, '0,3,6' -> those (each checked against n)."""
    if spec == "auto":
        return list(default)
    if spec == "all":
        return list(range(n))
    try:
        out = [int(s) for s in spec.split(",") if s.strip()]
    except ValueError:  # not a number: the same message as a number out of range
        out = []
    if not out or any(not 0 <= i < n for i in out):
        raise ValueError(f"accepted 'auto', 'all' or a comma list in 0..{n - 1}")
    return out


@dataclasses.dataclass
class RunAnalysis:
    run: capture.Run
    maps: capture.Analysis  # on the first --images images, with full attention
    stats: capture.Analysis  # on --stat_images images
    display: np.ndarray  # the --images images in [0, 1]
    labels: np.ndarray
    gates: dict


def analyze_run(workdir: str, images: int = 8, stat_images: int = 64,
                step: int | None = None, weights: str | None = None) -> RunAnalysis:
    run = capture.load_run(workdir, step, weights)
    x, y = capture.eval_images(run.config, run.data, max(images, stat_images))
    maps = capture.analyze(run, x[:images], full=True)
    stats = capture.analyze(run, x[:stat_images]) if stat_images != images else maps
    return RunAnalysis(run, maps, stats, capture.display_images(x[:images], run.data), y[:images],
                       gates.norm_gates(run.variables))


def write_maps(ra: RunAnalysis, out: str, heads: Sequence[int], blocks: Sequence[int]) -> list[str]:
    run, a = ra.run, ra.maps
    ema = ", EMA weights" if run.weights == "ema" else ""  # which model the figures show
    name, paths = (f"{colors.label(run.method)} ({tables.run_name(run.workdir)}, step "
                   f"{run.step}{ema})", [])
    rows = [f"image {i}\n(label {int(l)})" for i, l in enumerate(ra.labels)]
    cols = [f"block {b}" + ("" if a.has_cls[b] else "*") for b in blocks]
    for h in heads:
        maps = [[a.cls_maps[b][i, h] for b in blocks] for i in range(len(ra.display))]
        fig = plots_attention.overlay_grid(list(ra.display), maps, rows, cols,
                                           f"{name}: attention maps of head {h}")
        paths.append(figures.save(fig, os.path.join(out, f"attention_maps_head{h}.png")))
    for b in blocks:
        att = a.attention[b]
        prefix = att.shape[-1] - ra.maps.cls_maps[b][0, 0].size
        fig = plots_attention.matrix_figure(
            [att[:, h].mean(0) for h in heads], heads, prefix,
            f"{name}: block {b}, token-to-token attention (mean over {att.shape[0]} images)")
        paths.append(figures.save(fig, os.path.join(out, f"attention_matrix_block{b}.png")))
    return paths


def write_summaries(runs: Sequence[RunAnalysis], out: str, title: str,
                    palette: Mapping[str, tuple] | None = None) -> list[str]:
    """Distance scatter, token statistics and gates of one or several runs, with their CSVs.
    palette: method -> colour (the report's ``colors.palette``; None: from the runs' methods)."""
    pal = palette or colors.palette([r.run.method for r in runs])
    first = runs[0].run
    geometry = lambda run: capture.geometry(run.model.spec, run.config.data.image_size)
    grid, p = geometry(first)
    same_grid = all(geometry(r.run) == (grid, p) for r in runs)
    dup = len({r.run.method for r in runs}) < len(runs)  # name the run where methods repeat
    names = dict(zip(map(id, runs), tables.run_names([r.run.workdir for r in runs])))
    entry = lambda r, v: (f"{colors.label(r.run.method)} ({names[id(r)]})"
                          if dup else colors.label(r.run.method), pal[r.run.method], v)
    depth = max(r.stats.distance.shape[0] for r in runs)
    paths = [
        tables.write_csv(os.path.join(out, "attention_distance.csv"),
                         [row for r in runs
                          for row in tables.distance_rows(r.run, r.stats.distance, names[id(r)])]),
        tables.write_csv(os.path.join(out, "token_stats.csv"),
                         [row for r in runs
                          for row in tables.stats_rows(r.run, r.stats.stats, names[id(r)])]),
        tables.write_csv(os.path.join(out, "norm_gates.csv"),
                         [row for r in runs
                          for row in tables.gate_rows(r.run, r.gates, names[id(r)])],
                         ("run", "method", "step", "slot", "gate", "value")),
    ]
    n_img = runs[0].stats.distance.shape[1]
    fig = plots_attention.distance_figure(
        [entry(r, r.stats.distance.mean(1)) for r in runs],
        distance.uniform_distance(grid, p) if same_grid else None,
        f"{title}: mean attention distance per head ({n_img} eval images)")
    paths.append(figures.save(fig, os.path.join(out, "attention_distance.png")))
    fig = plots_stats.token_stats_figure([entry(r, r.stats.stats) for r in runs], depth,
                                         f"{title}: token statistics at each norm slot ({n_img} eval images)")
    paths.append(figures.save(fig, os.path.join(out, "token_stats.png")))
    gate_runs = [entry(r, r.gates) for r in runs]
    if plots_stats.gate_kinds(gate_runs):
        fig = plots_stats.gates_figure(gate_runs, depth, f"{title}: the norms' learned gates")
        paths.append(figures.save(fig, os.path.join(out, "norm_gates.png")))
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    from normvit_jax import logs
    logs.quiet_library_logs()
    ap = tool_flags.Parser("python -m normvit_jax.analysis.attention", __doc__)
    ap.add_argument("--workdir", required=True, help="a run's workdir (config.json, checkpoints/)")
    ap.add_argument("--out", required=True, help="folder for the PNG and CSV files")
    ap.add_argument("--images", type=map_images, default=8,
                    help=f"eval images shown in the maps (1..{MAX_IMAGES})")
    ap.add_argument("--stat_images", type=tool_flags.positive_int, default=64,
                    help="eval images averaged for distances and token statistics")
    ap.add_argument("--heads", default="0", help="'auto' (head 0, the default's choice), '0,1' or 'all' (maps and "
                                                "matrices)")
    ap.add_argument("--blocks", default="auto", help="'auto' (0/3/6/9 of 12), 'all' or '0,3'")
    ap.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    tool_flags.add_weights(ap)
    args = ap.parse_args(argv)
    from normvit_jax import cli
    with cli.tool_errors(ap.prog):  # docs/faults.md: one line and the table's exit code
        tool_flags.check_output("out", args.out, folder=True)  # before the work
        ra = analyze_run(args.workdir, args.images, args.stat_images, args.step, args.weights)
    depth, heads = ra.stats.distance.shape[0], ra.stats.distance.shape[2]
    try:
        hs = parse_indices(args.heads, heads, [0])
    except ValueError as e:
        print(f"{ap.prog}: error: --heads={args.heads}: {e} (the model has {heads} heads)",
              file=sys.stderr)
        return 2
    try:
        bs = parse_indices(args.blocks, depth, default_blocks(depth))
    except ValueError as e:
        print(f"{ap.prog}: error: --blocks={args.blocks}: {e} (the model has {depth} blocks)",
              file=sys.stderr)
        return 2
    paths = write_maps(ra, args.out, hs, bs)
    paths += write_summaries([ra], args.out, f"{colors.label(ra.run.method)} "
                                             f"({tables.run_name(args.workdir)}, step {ra.run.step}"
                                             + (", EMA weights" if ra.run.weights == "ema" else "")
                                             + ")")
    print("\n".join(paths))
    return 0


if __name__ == "__main__":
    from normvit_jax import logs as _logs  # absl's log format, as main.py's
    _logs.absl_format()
    sys.exit(main())
