"""Issue 26's ablation on the digits demo: LN, RepBN, progressive LN->RepBN, the seed's dynamic
feature normalization (z-score->RepBN, min-max->RepBN), DyT and Derf over several seeds.

    python -m benchmarks.norm_ablation --root=runs/ablation                 # run what is missing
    python -m benchmarks.norm_ablation --root=runs/ablation --summary_only  # table + figure
    python -m benchmarks.norm_ablation --root=runs/fm --config_args="--config.data.name=fmnist \\
        --config.data.data_dir=DIR --config.data.image_size=16 --config.model.patch_size=4"

Each run is ``main.py --config=configs/<file>:demo --config.seed=S`` in ``<root>/<key>_s<S>``,
evaluated every ``--eval_every`` steps (a finished workdir is not re-run). The summary prints a
markdown table: final top-1 (mean and min-max over the seeds), the first evaluated step at which a
run reaches 95% of LN's mean final top-1 (mean over seeds; '-' if a seed never does), and the
median train steps/s; ``--figure`` writes the top-1 curves (mean over seeds) against steps.
"""
from __future__ import annotations

import os
import subprocess
import sys
from typing import Sequence

import numpy as np

from normvit_jax import summaries, tool_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METHODS = (  # key, label, config
    ("ln", "LayerNorm", "vit_ln.py:demo"),
    ("repbn", "RepBN", "vit_repbn.py:demo"),
    ("prog_ln", "progressive LN->RepBN", "vit_progressive.py:demo"),
    ("zscore", "dynamic feature z-score->RepBN", "vit_dynamic_feature.py:demo"),
    ("minmax", "dynamic feature min-max->RepBN", "vit_dynamic_feature.py:demo,minmax"),
    ("dyt", "DyT", "vit_dyt.py:demo"),
    ("derf", "Derf", "vit_derf.py:demo"),
)


def run(root: str, key: str, config: str, seed: int, eval_every: int,
        overrides: Sequence[str] = ()) -> None:
    workdir = os.path.join(root, f"{key}_s{seed}")
    cmd = [sys.executable, os.path.join(REPO, "main.py"), f"--config={REPO}/configs/{config}",
           f"--workdir={workdir}", f"--config.seed={seed}", f"--config.eval_every={eval_every}",
           "--config.eval_analysis_images=0", *overrides]
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=REPO)


def _series(workdir: str, tag: str):
    s = summaries.read_run(workdir).scalars.get(tag)
    return (s.steps, s.values) if s is not None else (np.zeros(0), np.zeros(0))


def summary(root: str, seeds: Sequence[int], figure: str | None,
            title: str = "digits demo") -> str:
    curves = {}
    for key, label, _ in METHODS:
        runs = [os.path.join(root, f"{key}_s{s}") for s in seeds]
        runs = [r for r in runs if os.path.isdir(r)]
        done = [(r, _series(r, "eval/top1")) for r in runs]
        done = [(r, e) for r, e in done if len(e[0])]
        if done:
            curves[key] = (label, [e for _, e in done],
                           [_series(r, "train/steps_per_sec") for r, _ in done])
    # A run still training (its last eval before the others' last step) is left out.
    last = max((int(s[-1]) for _, evals, _ in curves.values() for s, _ in evals), default=0)
    for key in list(curves):
        label, evals, speeds = curves[key]
        keep = [i for i, (s, _) in enumerate(evals) if int(s[-1]) == last]
        if keep:
            curves[key] = (label, [evals[i] for i in keep], [speeds[i] for i in keep])
        else:
            del curves[key]
    if "ln" not in curves:
        return "no LN runs under " + root
    ln_final = float(np.mean([v[-1] for _, v in curves["ln"][1]]))
    target = 0.95 * ln_final
    rows = ["| norm | seeds | final top-1 (mean) | min-max | steps to 95% of LN's final "
            f"({100 * target:.1f}%) | train steps/s (median) |", "|---|---|---|---|---|---|"]
    for key, (label, evals, speeds) in curves.items():
        finals = np.asarray([v[-1] for _, v in evals])
        reach = []
        for steps, v in evals:
            hit = np.nonzero(v >= target)[0]
            reach.append(int(steps[hit[0]]) if len(hit) else None)
        reach_s = (f"{np.mean(reach):.0f}" if all(r is not None for r in reach) else
                   "- (" + ", ".join("-" if r is None else str(r) for r in reach) + ")")
        sps = [float(np.median(v)) for _, v in speeds if len(v)]
        rows.append(f"| {label} | {len(evals)} | {100 * finals.mean():.2f}% | "
                    f"{100 * finals.min():.2f}-{100 * finals.max():.2f}% | {reach_s} | "
                    f"{np.median(sps):.1f} |" if sps else " - |")
    if figure:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for key, (label, evals, _) in curves.items():
            n = min(len(s) for s, _ in evals)
            ax.plot(evals[0][0][:n], np.mean([v[:n] for _, v in evals], 0), label=label)
        ax.axhline(target, color="gray", ls=":", lw=1, label="95% of LN's final")
        ax.set(xlabel="train step", ylabel="eval top-1 (mean over seeds)", ylim=(0, 1),
               title=f"{title}: eval top-1 against steps")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(figure, dpi=120)
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> None:
    p = tool_flags.Parser("python -m benchmarks.norm_ablation", __doc__)
    p.add_argument("--root", default="runs/ablation", help="folder of the run workdirs")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    p.add_argument("--only", default="", help="comma-separated method keys (default: all)")
    p.add_argument("--eval_every", type=int, default=50, help="steps between evaluations")
    p.add_argument("--summary_only", action="store_true", help="run nothing, summarise")
    p.add_argument("--figure", default=None, help="write the top-1 curves to this .png")
    p.add_argument("--config_args", default="",
                   help="space-separated --config.KEY=VALUE flags added to every run, e.g. another "
                        "dataset: '--config.data.name=fmnist --config.data.data_dir=DIR'")
    p.add_argument("--title", default="digits demo", help="the figure's dataset name")
    args = p.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    only = {k for k in args.only.split(",") if k}
    unknown = only - {k for k, _, _ in METHODS}
    if unknown:
        print(f"--only: unknown key(s) {sorted(unknown)}; accepted: {[k for k, _, _ in METHODS]}",
              file=sys.stderr)
        sys.exit(2)
    if not args.summary_only:
        for seed in seeds:
            for key, _, config in METHODS:
                if not only or key in only:
                    run(args.root, key, config, seed, args.eval_every, args.config_args.split())
    print(summary(args.root, seeds, args.figure, args.title))


if __name__ == "__main__":
    main()
