"""What folding leaves of a norm: primitive counts of the eval forward's jaxpr, unfolded vs folded.

    python -m benchmarks.fold_ops [--model=Ti/16] [--depth=2] [--norms=layernorm,repbn,...]

Per benchmark norm (benchmarks.common.NORMS), the number of jaxpr equations whose primitive is a
normalization's: rsqrt/sqrt (standardisation), reduce_max/reduce_min (min-max), tanh/erf (DyT,
Derf), pow/exp/log (a norm written with ``jnp.power``, ``exp`` or ``log``; the attention softmax
has one exp per block), the reductions over channels or tokens (reduce_sum), and all equations;
the output names the counted primitives. A norm that folds
entirely (RepBN, progressive evaluating N2) has, folded, the counts of the 'identity' model: no
norm op left. Counts do not depend on the machine; no timing is done.
"""
from __future__ import annotations

import collections
from typing import Any, Sequence

import jax
import jax.numpy as jnp

from normvit_jax import cli, models, reparam, tool_flags

# the counted primitives (any other is only in 'all'): pow/exp/log are a norm's too (x^-p, a
# soft standardisation) and were missing, so a norm written with jnp.power counted 0 norm ops
WATCHED = ("rsqrt", "sqrt", "div", "reduce_sum", "reduce_max", "reduce_min", "tanh", "erf",
           "pow", "exp", "log")


def primitive_counts(closed_jaxpr: Any) -> collections.Counter:
    """Primitive name -> equations, sub-jaxprs (pjit, custom_jvp, scan bodies) included."""
    counts: collections.Counter = collections.Counter()

    def walk(jaxpr: Any) -> None:
        for eqn in jaxpr.eqns:
            counts[eqn.primitive.name] += 1
            for v in eqn.params.values():
                for sub in (v if isinstance(v, (list, tuple)) else [v]):
                    if hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
                        walk(sub.jaxpr)
                    elif hasattr(sub, "eqns"):
                        walk(sub)
    walk(closed_jaxpr.jaxpr)
    return counts


def eval_counts(model_cfg: Any, variables: Any, image_size: int,
                num_classes: int) -> collections.Counter:
    model = models.create(model_cfg, num_classes)
    x = jnp.zeros((1, image_size, image_size, 3))
    return primitive_counts(jax.make_jaxpr(lambda v: model.apply(v, x, train=False))(variables))


def rows(model: str, depth: int, names: Sequence[str], image_size: int = 32,
         num_classes: int = 10) -> list[dict]:
    from benchmarks import common
    out = []
    for name in ["identity"] + [n for n in names if n != "identity"]:
        cfg = common.bench_config(model, name, image_size=image_size, depth=depth).model
        m = models.create(cfg, num_classes)
        v = m.init(jax.random.key(0), jnp.zeros((1, image_size, image_size, 3)), train=False)
        out.append({"norm": name, "folded": False, **_row(eval_counts(cfg, v, image_size, num_classes))})
        fcfg = cfg.get("norm") or {"name": "layernorm"}
        if name != "identity" and (reparam.foldable(fcfg) or reparam.splittable(fcfg)):
            spec, fv, _ = reparam.fold(cfg, v)
            out.append({"norm": name, "folded": True,
                        **_row(eval_counts(spec, fv, image_size, num_classes))})
    return out


def _row(c: collections.Counter) -> dict:
    return {**{k: c.get(k, 0) for k in WATCHED}, "all": sum(c.values())}


PROG = "python -m benchmarks.fold_ops"


def main(argv: Sequence[str] | None = None) -> list[dict]:
    with cli.tool_errors(PROG):  # a bad --model: one line, exit 2
        return _main(argv)


def _main(argv: Sequence[str] | None) -> list[dict]:
    p = tool_flags.Parser(PROG, __doc__)
    p.add_argument("--model", default="Ti/16", help="ViT size, e.g. Ti/16")
    p.add_argument("--depth", type=tool_flags.positive_int, default=2, help="blocks (counts scale with it)")
    p.add_argument("--norms", default="layernorm,batchnorm,repbn,progressive,zscore_repbn,zscore,"
                   "minmax,dyt,derf", help="comma list of benchmarks.common.NORMS keys")
    args = p.parse_args(argv)
    from benchmarks import common
    names = [n for n in args.norms.split(",") if n]
    bad = [n for n in names if n not in common.NORMS]
    if bad:
        p.error(f"--norms: unknown {bad}; accepted: {list(common.NORMS)}")
    res = rows(args.model, args.depth, names)
    print(f"jaxpr equations of the eval forward, ViT-{args.model}, depth {args.depth}, batch 1; "
          f"counted primitives: {', '.join(WATCHED)} (any other only in 'all')\n")
    print("| norm | folded | " + " | ".join(WATCHED) + " | all |")
    print("|---|---|" + "---|" * (len(WATCHED) + 1))
    for r in res:
        print(f"| {r['norm']} | {'yes' if r['folded'] else 'no'} | "
              + " | ".join(str(r[k]) for k in WATCHED) + f" | {r['all']} |")
    return res


if __name__ == "__main__":
    main()
