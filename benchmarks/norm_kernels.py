"""One norm layer alone: forward + backward of a train-mode call on one activation, against LN.

    python -m benchmarks.norm_kernels --model=S/16 --batch=64 --dtype=bfloat16
    python -m benchmarks.norm_kernels --norm=layernorm,batchnorm,repbn,progressive --batch=256
    python -m benchmarks.norm_kernels --norm=all --xla_preset=default   # main.py's XLA flags
    python -m benchmarks.norm_kernels --model=B/16 --batch=256 --norm=layernorm,dtn,dtn_pallas \
        --dtn_tilings=64/64/8:16/32/8,32/64/8:32/32/8   # DTN's Pallas kernels cut other ways

The activation is (batch, tokens, width) of the model preset at its default image size (S/16 at
224 px: 197 tokens x 384); every norm gets the same random input and output cotangent. One timed
call is the gradient with respect to the input and the parameters plus the updated statistics
(what a norm slot costs in a train step, without the matmuls around it); ``eval`` times the
forward in eval mode. Rounds are interleaved (benchmarks.common.interleaved); ratios are per
round against LayerNorm. A layer that fails to build or compile (say a new GPU kernel) gets rows
'failed: <error>' and one stderr line; the others are timed (LayerNorm's failure stops it). Use
it to see a norm's own cost where a whole train step
(benchmarks.train_step) hides it, and to compare formulations of one norm.
"""
from __future__ import annotations

from benchmarks import xla_flags

xla_flags.apply()

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any, Callable, Sequence  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks import common  # noqa: E402
from normvit_jax import models, norms, tool_flags  # noqa: E402


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = tool_flags.Parser("python -m benchmarks.norm_kernels", __doc__)
    p.add_argument("--model", default="S/16", help="preset giving tokens and width")
    p.add_argument("--norm", default="layernorm,batchnorm,repbn,progressive,zscore_repbn,dyt",
                   help=f"'all' or a comma list of {list(common.NORMS)}")
    p.add_argument("--batch", type=tool_flags.positive_int, default=64, help="global batch")
    p.add_argument("--dtype", default="bfloat16", choices=list(common.DTYPES),
                   help="compute dtype (parameters stay float32)")
    p.add_argument("--steps", type=tool_flags.positive_int, default=10, help="timed rounds")
    p.add_argument("--warmup", type=tool_flags.non_negative_int, default=2,
                   help="untimed rounds first")
    p.add_argument("--xla_preset", default=xla_flags.DEFAULT_PRESET, choices=list(xla_flags.PRESETS),
                   help="XLA flags (benchmarks/xla_flags.py); 'default' is what main.py runs with")
    p.add_argument("--dtn_tilings", default="",
                   help="comma list of DTN's pallas_tiling values ('F:B', docs/norms.md), each "
                        "timed as a row 'dtn_pallas@F:B' beside the others")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    if args.norm != "all":  # 'all' leaves them out; a named one had no row and no word
        layout = [n for n in common.norm_names(args.norm) if set(common.NORMS[n]) - {"norm"}]
        if layout:
            p.error(f"--norm: {layout} change the model layout, not one layer; time them with "
                    "benchmarks.train_step")
    from normvit_jax.norms import dtn_pallas
    for tiling in filter(None, args.dtn_tilings.split(",")):
        try:
            dtn_pallas.parse_tiling(tiling)
        except ValueError as e:
            p.error(f"--dtn_tilings: {e}")
    return args


def _norm_cfg(name: str) -> Any:
    if "@" in name:  # dtn_pallas@F:B, one of --dtn_tilings
        base, tiling = name.split("@", 1)
        return {**_norm_cfg(base), "pallas_tiling": tiling}
    changes = common.NORMS[name]
    if set(changes) - {"norm"}:
        raise SystemExit(f"--norm: {name!r} changes the model layout, not one layer; "
                         "time it with benchmarks.train_step")
    return changes.get("norm", norms.DEFAULT)


def make_runner(name: str, shape: tuple[int, int, int], num_heads: int, dtype: Any
                ) -> tuple[Callable[[], float], Callable[[], float]]:
    """(train fwd+bwd runner, eval forward runner), each returning one call's seconds."""
    b, t, c = shape
    layer = norms.create(_norm_cfg(name), dim=c, num_heads=num_heads,
                         grid=(int((t - 1) ** 0.5),) * 2, num_prefix_tokens=1, slot="block")
    kx, kg = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, shape, jnp.float32).astype(dtype)
    ct = jax.random.normal(kg, shape, jnp.float32).astype(dtype)
    step = jnp.asarray(100, jnp.int32)  # inside a progressive norm's hand-over
    kwargs = {"step": step} if getattr(type(layer), "TAKES_STEP", False) else {}
    variables = layer.init(jax.random.key(1), x, train=False, **kwargs)
    params = variables.get("params", {})
    state = {k: v for k, v in variables.items() if k != "params"}

    def loss(p: Any, x: jax.Array) -> tuple[jax.Array, Any]:
        y, new_state = layer.apply({"params": p, **state}, x, train=True, mutable=True, **kwargs)
        return jnp.sum(y.astype(jnp.float32) * ct.astype(jnp.float32)), new_state

    train = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))
    evaluate = jax.jit(lambda p, x: layer.apply({"params": p, **state}, x, train=False,
                                                **kwargs))

    def timed(fn: Callable, *args: Any) -> Callable[[], float]:
        jax.block_until_ready(fn(*args))  # compile outside the timed rounds

        def call() -> float:
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            return time.perf_counter() - t0
        return call

    return timed(train, params, x), timed(evaluate, params, x)


def run(args: argparse.Namespace) -> dict[str, Any]:
    spec = models.spec_of({"variant": args.model}, 1000)
    size = common.default_image_size(args.model)
    tokens = (size // spec.patch_size) ** 2 + 1
    shape = (args.batch, tokens, spec.hidden_size)
    names = common.norm_names(args.norm)
    names = [n for n in names if set(common.NORMS[n]) <= {"norm"}]  # one-layer norms only
    names += [f"dtn_pallas@{t}" for t in filter(None, args.dtn_tilings.split(","))]
    runners, failed = {}, {}
    for n in names:  # a layer that does not build or compile (a new GPU kernel) costs its rows only
        try:
            runners[n] = make_runner(n, shape, spec.num_heads, common.DTYPES[args.dtype])
        except Exception as e:  # noqa: BLE001
            if n == "layernorm":
                raise
            failed[n] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}" if str(e) \
                else f"failed: {type(e).__name__}"
            print(f"norm_kernels: {n}: {failed[n]}", file=sys.stderr, flush=True)
    rows = []
    for mode, i in (("train", 0), ("eval", 1)):
        times = common.interleaved({n: r[i] for n, r in runners.items()}, args.steps,
                                   args.warmup)
        ratios = common.paired_ratios(times, "layernorm")
        for n in names:
            if n in failed:
                rows.append({"mode": mode, "norm": n, "ms": failed[n], "ratio_to_ln": "-"})
                continue
            s = common.summarize(times[n])
            rows.append({"mode": mode, "norm": n, "ms": s.fmt(1e3, 2),
                         "ratio_to_ln": ratios[n].fmt()})
    return {"machine": common.machine(), "args": vars(args), "shape": shape, "rows": rows,
            "failed": failed}


def report(res: dict[str, Any]) -> str:
    b, t, c = res["shape"]
    return (f"activation ({b}, {t}, {c}) {res['args']['dtype']}; train = fwd+bwd+statistics, "
            "eval = forward\n" + common.table(res["rows"], ("mode", "norm", "ms", "ratio_to_ln")))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    return common.run_entry(parse, run, report, argv)


if __name__ == "__main__":
    main()
