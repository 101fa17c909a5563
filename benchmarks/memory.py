"""Largest per-device batch whose train step fits in a device's memory, per model size, with and
without activation checkpointing (``config.remat``).

    python -m benchmarks.memory --models=Ti/16,S/16,B/16,L/16 --memory_gb=16,40,80

Nothing is allocated: the train step is compiled for abstract inputs at two small per-device
batches and XLA's buffer assignment (arguments + outputs + temporaries - donated aliases) gives
memory = fixed + per_sample * batch; the largest batch under each budget follows, and with
``--verify`` it is compiled once more to check. The estimate is the compiling backend's own (run
on the accelerator for its numbers). Beyond the largest batch, ``config.grad_accum_steps`` splits
a global batch into micro-batches that do fit.
"""
from __future__ import annotations

from benchmarks import xla_flags

xla_flags.apply()

import argparse  # noqa: E402
import sys  # noqa: E402
from typing import Any, Sequence  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import common  # noqa: E402
from normvit_jax import tool_flags  # noqa: E402


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = tool_flags.Parser("python -m benchmarks.memory", __doc__)
    p.add_argument("--models", default="Ti/16,S/16,B/16,L/16",
                   help="comma list of ViT presets '<size>/<patch>'")
    p.add_argument("--norm", default="layernorm", help=f"one of {list(common.NORMS)}")
    p.add_argument("--image_size", type=tool_flags.positive_int, default=None,
                   help="input resolution (default: 32 for a patch of at most 8, else 224)")
    p.add_argument("--depth", type=tool_flags.positive_int, default=None,
                   help="transformer blocks (default: the model preset's)")
    p.add_argument("--dtype", default="float32", choices=list(common.DTYPES),
                   help="compute dtype (parameters stay float32)")
    p.add_argument("--memory_gb", default="16,40,80",
                   help="device memory budgets in GiB (the device's own limit is added if known)")
    p.add_argument("--probe_batches", default="4,8", help="two per-device batches to fit from")
    p.add_argument("--scan", action="store_true", help="nn.scan over the blocks (model.scan)")
    p.add_argument("--verify", action="store_true", help="compile at each predicted batch too")
    p.add_argument("--num_classes", type=tool_flags.positive_int, default=1000, help="classes of the head")
    p.add_argument("--xla_preset", default=xla_flags.DEFAULT_PRESET, choices=list(xla_flags.PRESETS),
                   help="XLA:CPU flags set before JAX starts: tuned (this project's measured "
                        "settings) or default (XLA's own); benchmarks/xla_flags.py")
    p.add_argument("--json", default=None, help="also write the results as JSON to this file")
    args = p.parse_args(argv)
    # checked here, not as a KeyError / ValueError / ZeroDivisionError traceback mid-run
    if args.norm not in common.NORMS:
        p.error(f"--norm: unknown {args.norm!r}; accepted: one of {list(common.NORMS)}")
    try:
        budgets = [float(x) for x in args.memory_gb.split(",") if x.strip()]
    except ValueError:
        budgets = []
    if not budgets or min(budgets) <= 0:
        p.error(f"--memory_gb={args.memory_gb}: accepted: a comma list of GiB > 0")
    try:
        probes = [tool_flags.positive_int(x) for x in args.probe_batches.split(",")]
    except (ValueError, argparse.ArgumentTypeError):
        probes = []
    if len(probes) != 2 or probes[0] == probes[1]:
        p.error(f"--probe_batches={args.probe_batches}: accepted: two different integers >= 1")
    return args


def step_bytes(model_name: str, args: argparse.Namespace, per_device_batch: int,
               remat: bool) -> tuple[int, int]:
    """(XLA's peak bytes of one train step at this per-device batch, parameter count)."""
    n_dev = jax.device_count()
    cfg = common.bench_config(model_name, args.norm, image_size=args.image_size,
                              batch=per_device_batch * n_dev, dtype=args.dtype, remat=remat,
                              scan=args.scan, num_classes=args.num_classes, depth=args.depth)
    lowered, state = common.lower_abstract_train_step(cfg, args.num_classes)
    compiled = lowered.compile(compiler_options=xla_flags.compiler_options())
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))
    return common.memory_stats(compiled)["xla_peak"], n_params


def run(args: argparse.Namespace) -> dict[str, Any]:
    budgets = [float(x) for x in args.memory_gb.split(",") if x.strip()]
    limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
    if limit:
        budgets.append(round(limit / 2 ** 30, 2))
    b1, b2 = (int(x) for x in args.probe_batches.split(","))
    rows = []
    for m in [x.strip() for x in args.models.split(",") if x.strip()]:
        for remat in (False, True):
            m1, n_params = step_bytes(m, args, b1, remat)
            m2, _ = step_bytes(m, args, b2, remat)
            per = (m2 - m1) / (b2 - b1)
            fixed = m1 - per * b1
            row: dict[str, Any] = {"model": m, "remat": remat, "params_M": round(n_params / 1e6, 1),
                                   "fixed_GiB": round(fixed / 2 ** 30, 3),
                                   "per_sample_MiB": float(f"{per / 2 ** 20:.4g}")}
            for g in budgets:
                best = int((g * 2 ** 30 - fixed) // per) if per > 0 else None
                if best is not None and best > 0 and args.verify:
                    while best > 0 and step_bytes(m, args, best, remat)[0] > g * 2 ** 30:
                        best = int(best * 0.95)
                row[f"max_batch@{g:g}GiB"] = max(best, 0) if best is not None else None
            rows.append(row)
            print(f"{m} remat={remat}: fixed {fixed / 2 ** 30:.2f} GiB, {per / 2 ** 20:.1f} MiB/sample",
                  file=sys.stderr, flush=True)
    return {"machine": common.machine(), "args": vars(args), "rows": rows, "budgets": budgets}


def report(res: dict[str, Any]) -> str:
    a = res["args"]
    cols = ["model", "remat", "params_M", "fixed_GiB", "per_sample_MiB"] + [
        f"max_batch@{g:g}GiB" for g in res["budgets"]]
    head = (f"largest per-device batch (train step, norm={a['norm']}, dtype={a['dtype']}, "
            f"image={a['image_size'] or 'default'}{',' * bool(a['depth'])}{common.depth_label(a)}, "
            f"scan={a['scan']}; XLA buffer assignment on "
            f"{res['machine']['backend']})")
    return head + "\n" + common.table(res["rows"], cols)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    return common.run_entry(parse, run, report, argv)


if __name__ == "__main__":
    main()
