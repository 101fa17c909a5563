"""Compile time of the train step against depth, unrolled and with ``model.scan``.

    python -m benchmarks.compile_time --model=Ti/4 --depths=12,36 --repeats=2

Time = tracing + lowering (Python, flax) and XLA compilation, for abstract inputs (nothing is
allocated or run). Depths and layouts are measured round-robin, ``--repeats`` times each; the
report gives medians and each layout's ratio of its deepest to its shallowest depth (the target:
depth 36 under twice depth 12 with scan).
"""
from __future__ import annotations

from benchmarks import xla_flags

xla_flags.apply()

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any, Sequence  # noqa: E402


from benchmarks import common  # noqa: E402
from normvit_jax import tool_flags  # noqa: E402


LAYOUTS = ("unrolled", "scan")


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = tool_flags.Parser("python -m benchmarks.compile_time", __doc__)
    p.add_argument("--model", default="Ti/4", help="ViT preset '<size>/<patch>', e.g. Ti/4, S/16")
    p.add_argument("--norm", default="layernorm",
                   help="the normalizer of every slot (benchmarks/common.py NORMS)")
    p.add_argument("--depths", default="12,36", help="comma list of depths to compile")
    p.add_argument("--layouts", default="unrolled,scan",
                   help="comma list of block layouts: unrolled, scan (model.scan)")
    p.add_argument("--batch", type=tool_flags.positive_int, default=128, help="global batch")
    p.add_argument("--image_size", type=tool_flags.positive_int, default=None,
                   help="input resolution (default: 32 for a patch of at most 8, else 224)")
    p.add_argument("--remat", action="store_true",
                   help="activation checkpointing per block (config.remat)")
    p.add_argument("--repeats", type=tool_flags.positive_int, default=1,
                   help="timed rounds (the median is reported)")
    p.add_argument("--xla_preset", default=xla_flags.DEFAULT_PRESET, choices=list(xla_flags.PRESETS),
                   help="XLA:CPU flags set before JAX starts: tuned (this project's measured "
                        "settings) or default (XLA's own); benchmarks/xla_flags.py")
    p.add_argument("--json", default=None, help="also write the results as JSON to this file")
    args = p.parse_args(argv)
    common.check_norm(args.norm)
    try:
        args.depths = [tool_flags.positive_int(d) for d in args.depths.split(",")]
    except (ValueError, argparse.ArgumentTypeError):
        p.error(f"--depths={args.depths}: accepted: a comma list of integers >= 1")
    args.layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    bad = [x for x in args.layouts if x not in LAYOUTS]
    if bad or not args.layouts:  # any other name was compiled as 'unrolled' under its own name
        p.error(f"--layouts: unknown {bad}; accepted: a comma list of {list(LAYOUTS)}")
    return args


def compile_once(args: argparse.Namespace, depth: int, scan: bool) -> tuple[float, float]:
    """(trace + lower seconds, XLA compile seconds) of a fresh train step."""
    cfg = common.bench_config(args.model, args.norm, image_size=args.image_size, batch=args.batch,
                              remat=args.remat, scan=scan, depth=depth)
    t0 = time.perf_counter()
    lowered, _ = common.lower_abstract_train_step(cfg)
    t1 = time.perf_counter()
    lowered.compile(compiler_options=xla_flags.compiler_options())
    return t1 - t0, time.perf_counter() - t1


def run(args: argparse.Namespace) -> dict[str, Any]:
    depths, layouts = args.depths, args.layouts
    runs: dict[tuple[str, int], list[tuple[float, float]]] = {(l, d): [] for l in layouts for d in depths}
    for r in range(args.repeats):
        keys = list(runs)
        keys = keys[r % len(keys):] + keys[:r % len(keys)]
        for layout, depth in keys:
            runs[(layout, depth)].append(compile_once(args, depth, layout == "scan"))
            lo, co = runs[(layout, depth)][-1]
            print(f"{layout} depth {depth}: trace+lower {lo:.1f} s, compile {co:.1f} s",
                  file=sys.stderr, flush=True)
    rows = []
    for layout in layouts:
        base = None
        for d in depths:
            total = common.summarize([a + b for a, b in runs[(layout, d)]]).median
            base = base or total
            rows.append({"layout": layout, "depth": d,
                         "trace_lower_s": round(common.summarize([a for a, _ in runs[(layout, d)]]).median, 2),
                         "compile_s": round(common.summarize([b for _, b in runs[(layout, d)]]).median, 2),
                         "total_s": round(total, 2), "vs_first_depth": round(total / base, 2)})
    return {"machine": common.machine(), "args": vars(args), "rows": rows}


def report(res: dict[str, Any]) -> str:
    a = res["args"]
    head = (f"train-step compile time: model={a['model']} norm={a['norm']} batch={a['batch']} "
            f"remat={a['remat']}; median of {a['repeats']}")
    return head + "\n" + common.table(res["rows"], ["layout", "depth", "trace_lower_s", "compile_s",
                                                   "total_s", "vs_first_depth"])


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    return common.run_entry(parse, run, report, argv)


if __name__ == "__main__":
    main()
