"""Issue 26's ablation on the digits demo: LN, RepBN, progressive LN->RepBN, the seed's dynamic
feature normalization (z-score->RepBN, min-max->RepBN), DyT and Derf over several seeds.

    python -m benchmarks.norm_ablation --root=runs/ablation                 # run what is missing, report
    python -m benchmarks.norm_ablation --root=runs/ablation --summary_only  # report only
    python -m benchmarks.norm_ablation --root=runs/fm --config_args="--config.data.name=fmnist \\
        --config.data.data_dir=DIR --config.data.image_size=16 --config.model.patch_size=4"

Each run is ``main.py --config=configs/<file>:demo --config.seed=S`` in ``<root>/<key>_s<S>``,
evaluated every ``--eval_every`` steps (a finished workdir is not re-run). The runs are then
reported by ``python -m normvit_jax.analysis.report <workdirs> --out=<--out> --no_attention``
(the command is printed): its convergence table (final top-1 mean and min-max over the seeds,
the first evaluated step at which a run reaches 95% of LN's mean final top-1, mean over seeds)
is printed, and ``convergence.png`` (mean curve and min-max band per method) is written with
report.md and the other report files into ``--out``.
"""
from __future__ import annotations

import os
import subprocess
import sys
from typing import Sequence

from normvit_jax import cli, tool_flags
from normvit_jax.analysis import report

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METHODS = (  # key (the workdir's prefix), config; the report names the methods from the configs
    ("ln", "vit_ln.py:demo"),
    ("repbn", "vit_repbn.py:demo"),
    ("prog_ln", "vit_progressive.py:demo"),
    ("zscore", "vit_dynamic_feature.py:demo"),
    ("minmax", "vit_dynamic_feature.py:demo,minmax"),
    ("dyt", "vit_dyt.py:demo"),
    ("derf", "vit_derf.py:demo"),
)


def run(root: str, key: str, config: str, seed: int, eval_every: int,
        overrides: Sequence[str] = ()) -> None:
    workdir = os.path.join(root, f"{key}_s{seed}")
    cmd = [sys.executable, os.path.join(REPO, "main.py"), f"--config={REPO}/configs/{config}",
           f"--workdir={workdir}", f"--config.seed={seed}", f"--config.eval_every={eval_every}",
           "--config.eval_analysis_images=0", *overrides]
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=REPO)


def workdirs(root: str, seeds: Sequence[int]) -> list[str]:
    """The runs' workdirs that exist, method by method (the table's order), then seed by seed."""
    runs = [os.path.join(root, f"{key}_s{s}") for key, _ in METHODS for s in seeds]
    return [r for r in runs if os.path.isdir(r)]


def main(argv: Sequence[str] | None = None) -> None:
    """Bad input: one line and exit 2, Ctrl-C one line and 130 (docs/faults.md)."""
    with cli.tool_errors("python -m benchmarks.norm_ablation"):
        _main(argv)


def _main(argv: Sequence[str] | None) -> None:
    p = tool_flags.Parser("python -m benchmarks.norm_ablation", __doc__)
    p.add_argument("--root", default="runs/ablation", help="folder of the run workdirs")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    p.add_argument("--only", default="", help="comma-separated method keys (default: all)")
    p.add_argument("--eval_every", type=tool_flags.positive_int, default=50, help="steps between evaluations")
    p.add_argument("--summary_only", action="store_true", help="run nothing, write the report")
    p.add_argument("--out", default=None, help="the report's folder (default: <root>/report)")
    p.add_argument("--config_args", default="",
                   help="space-separated --config.KEY=VALUE flags added to every run, e.g. another "
                        "dataset: '--config.data.name=fmnist --config.data.data_dir=DIR'")
    args = p.parse_args(argv)
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:  # was a traceback
        p.error(f"--seeds={args.seeds}: accepted: a comma list of integers")
    only = {k for k in args.only.split(",") if k}
    unknown = only - {k for k, _ in METHODS}
    if unknown:
        raise ValueError(f"--only: unknown key(s) {sorted(unknown)}; accepted: "
                         f"{[k for k, _ in METHODS]}")
    if not args.summary_only:
        for seed in seeds:
            for key, config in METHODS:
                if not only or key in only:
                    run(args.root, key, config, seed, args.eval_every, args.config_args.split())
    runs = workdirs(args.root, seeds)
    if not runs:
        raise ValueError(f"--root={args.root}: no <key>_s<seed> workdirs for --seeds={args.seeds}; "
                         "train them first (without --summary_only)")
    rargs = runs + [f"--out={args.out or os.path.join(args.root, 'report')}", "--no_attention"]
    print("python -m normvit_jax.analysis.report " + " ".join(rargs), flush=True)
    sys.exit(report.main(rargs))


if __name__ == "__main__":
    main()
