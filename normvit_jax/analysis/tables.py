"""CSV rows of the per-run analysis: attention distances, token statistics, norm gates."""
from __future__ import annotations

import csv
import os
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

STAT_KEYS = ("chan_mean", "chan_var", "tok_mean", "tok_var", "max_abs")


def run_name(workdir: str) -> str:
    return os.path.basename(os.path.normpath(str(workdir)))


def distance_rows(run: Any, distance: np.ndarray) -> list[dict]:
    """distance: (depth, B, H) pixels -> one row per (block, head), mean and std over images."""
    rows = []
    for b in range(distance.shape[0]):
        for h in range(distance.shape[2]):
            d = distance[b, :, h]
            rows.append(dict(run=run_name(run.workdir), method=run.method, step=run.step, block=b,
                             head=h, distance_px=float(d.mean()), distance_std_px=float(d.std()),
                             images=len(d)))
    return rows


def stats_rows(run: Any, stats: Mapping[str, Mapping[str, Mapping[str, float]]]) -> list[dict]:
    rows = []
    for slot in sorted(stats):
        for side in ("in", "out"):
            if side in stats[slot]:
                rows.append(dict(run=run_name(run.workdir), method=run.method, step=run.step,
                                 slot=slot, side=side,
                                 **{k: stats[slot][side][k] for k in STAT_KEYS}))
    return rows


def gate_rows(run: Any, gates: Mapping[str, Mapping[str, float]]) -> list[dict]:
    return [dict(run=run_name(run.workdir), method=run.method, step=run.step, slot=slot, gate=g,
                 value=v) for slot in sorted(gates) for g, v in gates[slot].items()]


def write_csv(path: str, rows: Sequence[dict], fields: Iterable[str] | None = None) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fields = list(fields or (rows[0].keys() if rows else []))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})
    return path

