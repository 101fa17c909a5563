"""Eval-mode throughput per normalizer (``model.apply(..., train=False)``, jitted, batch sharded).

    python -m benchmarks.inference --model=Ti/4 --norm=all --batch=256 --steps=10

Stateful norms run their inference form (running statistics). With ``--fold`` every norm that
folds into the next Dense at inference (normvit_jax/reparam.py: BatchNorm, UN, LearnableScaler,
Rescale, RepBN, progressive; DyT, Derf, zscore and minmax fold their scale/bias) is also timed
folded, as the row '<norm>+folded', in the same interleaved rounds.
"""
from __future__ import annotations

from benchmarks import xla_flags

xla_flags.apply()

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any, Callable, Sequence  # noqa: E402

import jax  # noqa: E402

from benchmarks import common  # noqa: E402
from normvit_jax import tool_flags  # noqa: E402
from normvit_jax import models, reparam, sharding  # noqa: E402


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = tool_flags.Parser("python -m benchmarks.inference", __doc__)
    p.add_argument("--model", default="Ti/4", help="ViT preset '<size>/<patch>', e.g. Ti/4, S/16")
    p.add_argument("--norm", default="all", help=f"'all' or a comma list of {list(common.NORMS)}")
    p.add_argument("--batch", type=tool_flags.positive_int, default=256, help="global batch")
    p.add_argument("--dtype", default="float32", choices=list(common.DTYPES),
                   help="compute dtype (parameters stay float32)")
    p.add_argument("--steps", type=tool_flags.positive_int, default=10, help="timed rounds")
    p.add_argument("--warmup", type=tool_flags.non_negative_int, default=2,
                   help="untimed rounds before the timed ones")
    p.add_argument("--image_size", type=tool_flags.positive_int, default=None,
                   help="input resolution (default: 32 for a patch of at most 8, else 224)")
    p.add_argument("--depth", type=tool_flags.positive_int, default=None,
                   help="transformer blocks (default: the model preset's)")
    p.add_argument("--num_classes", type=tool_flags.positive_int, default=10, help="classes of the head")
    p.add_argument("--scan", action="store_true", help="nn.scan over the blocks (model.scan)")
    p.add_argument("--fold", action="store_true",
                   help="also time each foldable norm folded into the next Dense ('<norm>+folded')")
    p.add_argument("--xla_preset", default=xla_flags.DEFAULT_PRESET, choices=list(xla_flags.PRESETS),
                   help="XLA:CPU flags set before JAX starts: tuned (this project's measured "
                        "settings) or default (XLA's own); benchmarks/xla_flags.py")
    p.add_argument("--json", default=None, help="also write the results as JSON to this file")
    return p.parse_args(argv)


def compile_eval(name: str, args: argparse.Namespace,
                 fold: bool = False) -> tuple[Callable[[], float], float, Any]:
    cfg = common.bench_config(args.model, name, image_size=args.image_size, batch=args.batch,
                              dtype=args.dtype, scan=args.scan, num_classes=args.num_classes,
                              depth=args.depth)
    mesh = sharding.make_mesh()
    model = models.create(cfg.model, args.num_classes, dtype=common.DTYPES[args.dtype])
    size = int(cfg.data.image_size)
    variables = jax.jit(lambda r: model.init(r, jax.numpy.zeros((1, size, size, 3)), train=False),
                        out_shardings=sharding.replicated(mesh))(jax.random.key(0))
    if fold:
        folded, variables, _ = reparam.fold(model.spec, variables)
        model = models.create(folded)
        variables = jax.device_put(variables, sharding.replicated(mesh))
    images = common.synthetic_batch(args.batch, size, args.num_classes, mesh)["image"]
    fn = jax.jit(lambda v, x: model.apply(v, x, train=False),
                 in_shardings=(sharding.replicated(mesh), sharding.batch_sharding(mesh)))
    t = time.perf_counter()
    compiled = fn.lower(variables, images).compile(compiler_options=xla_flags.compiler_options())
    compile_s = time.perf_counter() - t

    def run() -> float:
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(variables, images))
        return time.perf_counter() - t0

    return run, compile_s, common.cost_flops(compiled)


def _folds(name: str) -> bool:
    """Whether the benchmark norm ``name`` (a key of common.NORMS) folds, wholly or its scale/bias."""
    cfg = common.NORMS[name].get("norm", {"name": "layernorm"})
    return reparam.foldable(cfg) or reparam.splittable(cfg)


def run(args: argparse.Namespace) -> dict[str, Any]:
    names = common.norm_names(args.norm)
    runners, compile_s, flops = {}, {}, {}
    jobs = [(n, n, False) for n in names]
    if args.fold:
        jobs += [(f"{n}+folded", n, True) for n in names if _folds(n)]
    for label, n, fold in jobs:
        runners[label], compile_s[label], flops[label] = compile_eval(n, args, fold)
        print(f"compiled {label}: {compile_s[label]:.1f} s", file=sys.stderr, flush=True)
    names = [label for label, _, _ in jobs]
    times = common.interleaved(runners, args.steps, args.warmup)
    ratios = common.paired_ratios(times, "layernorm") if "layernorm" in names else {}
    rows = []
    for n in names:
        s = common.summarize(times[n])
        rows.append({"norm": n, "compile_s": round(compile_s[n], 1), "batch_s": s.fmt(),
                     "images_per_s": round(args.batch / s.median, 1),
                     "gflops_per_batch": None if flops[n] is None else round(flops[n] / 1e9, 2),
                     "flops_per_batch": flops[n],
                     "time_ratio": ratios[n].fmt() if ratios else None,
                     "flop_ratio": (round(flops[n] / flops["layernorm"], 4)
                                    if ratios and flops[n] and flops["layernorm"] else None)})
    return {"machine": common.machine(), "args": vars(args), "rows": rows, "times": times}


def report(res: dict[str, Any]) -> str:
    a = res["args"]
    head = (f"inference (train=False): model={a['model']}{common.depth_label(a)} "
            f"image={a['image_size'] or 'default'} batch={a['batch']} dtype={a['dtype']}; "
            f"{a['steps']} timed rounds; batch time median [p25, p75] s")
    cols = ["norm", "compile_s", "batch_s", "images_per_s", "gflops_per_batch", "time_ratio",
            "flop_ratio"]
    return head + "\n" + common.table(res["rows"], cols)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    return common.run_entry(parse, run, report, argv)


if __name__ == "__main__":
    main()
