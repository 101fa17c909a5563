"""CSV rows of the per-run analysis: attention distances, token statistics, norm gates."""
from __future__ import annotations

import csv
import os
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

STAT_KEYS = ("chan_mean", "chan_var", "tok_mean", "tok_var", "max_abs")


def run_name(workdir: str) -> str:
    return os.path.basename(os.path.normpath(str(workdir)))


def run_names(workdirs: Sequence[str]) -> list[str]:
    """Each run's name: its folder's base name, or, where base names collide (``a/ln b/ln``),
    the shortest path suffix that tells the colliding runs apart (``a/ln``, ``b/ln``): the same
    name for two runs made their table rows, report.json and legends indistinguishable."""
    parts = [os.path.abspath(str(w)).strip(os.sep).split(os.sep) for w in workdirs]
    names = [run_name(w) for w in workdirs]
    for base in {n for n in names if names.count(n) > 1}:
        group = [i for i, n in enumerate(names) if n == base]
        for k in range(2, max(len(parts[i]) for i in group) + 1):
            suffix = {i: os.sep.join(parts[i][-k:]) for i in group}
            if len(set(suffix.values())) == len(group):
                break
        for i in group:  # a path named whole (a suffix of another's) keeps its root
            names[i] = suffix[i] if len(parts[i]) > k else os.path.abspath(str(workdirs[i]))
    return names


def distance_rows(run: Any, distance: np.ndarray, name: str | None = None) -> list[dict]:
    """distance: (depth, B, H) pixels -> one row per (block, head), mean and population std
    (ddof=0) over the ``images`` images.
    name: the run's name in the rows (default: ``run_name`` of its workdir)."""
    name = name or run_name(run.workdir)
    rows = []
    for b in range(distance.shape[0]):
        for h in range(distance.shape[2]):
            d = distance[b, :, h]
            rows.append(dict(run=name, method=run.method, step=run.step, block=b,
                             head=h, distance_px=float(d.mean()), distance_std_px=float(d.std()),
                             images=len(d)))
    return rows


def stats_rows(run: Any, stats: Mapping[str, Mapping[str, Mapping[str, float]]],
               name: str | None = None) -> list[dict]:
    name = name or run_name(run.workdir)
    rows = []
    for slot in sorted(stats):
        for side in ("in", "out"):
            if side in stats[slot]:
                rows.append(dict(run=name, method=run.method, step=run.step, slot=slot, side=side,
                                 **{k: stats[slot][side][k] for k in STAT_KEYS}))
    return rows


def gate_rows(run: Any, gates: Mapping[str, Mapping[str, float]],
              name: str | None = None) -> list[dict]:
    name = name or run_name(run.workdir)
    return [dict(run=name, method=run.method, step=run.step, slot=slot, gate=g, value=v)
            for slot in sorted(gates) for g, v in gates[slot].items()]


def write_csv(path: str, rows: Sequence[dict], fields: Iterable[str] | None = None) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fields = list(fields or (rows[0].keys() if rows else []))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})
    return path

