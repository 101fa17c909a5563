"""The train step's matrix products at the model's shapes, in XLA and in PyTorch, one by one.

    python -m benchmarks.matmul --model=Ti/4 --batch=128 --repeats=9

Every matmul of one block's forward and backward (the linear layers: forward, input gradient,
weight gradient with the contraction over the B*T tokens; the attention products batched over
B*H) is timed alone in XLA (a jitted ``lax.dot_general`` with the contraction autodiff produces,
the harness's XLA flags) and in torch (``mm``/``bmm`` on transposed views), alternating, median of
``--repeats``. Multiplied by the number of blocks this is the matmul time of a step in each
library: if XLA's sum is larger by about the step-time gap, the gap is the kernel library, not the
model code around it. torch is optional here (XLA-only columns without it).
"""
from __future__ import annotations

from benchmarks import xla_flags

xla_flags.apply()

import argparse  # noqa: E402
import time  # noqa: E402
from typing import Any, Callable, Sequence  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import common  # noqa: E402
from normvit_jax import tool_flags  # noqa: E402
from normvit_jax import models  # noqa: E402


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = tool_flags.Parser("python -m benchmarks.matmul", __doc__)
    p.add_argument("--model", default="Ti/4", help="ViT preset '<size>/<patch>', e.g. Ti/4, S/16")
    p.add_argument("--batch", type=tool_flags.positive_int, default=128, help="global batch")
    p.add_argument("--image_size", type=tool_flags.positive_int, default=None,
                   help="input resolution (default: 32 for a patch of at most 8, else 224)")
    p.add_argument("--depth", type=tool_flags.positive_int, default=None,
                   help="transformer blocks (default: the model preset's)")
    p.add_argument("--repeats", type=tool_flags.positive_int, default=9,
                   help="timed rounds (the median is reported)")
    p.add_argument("--no_torch", action="store_true", help="XLA only")
    p.add_argument("--xla_preset", default=xla_flags.DEFAULT_PRESET, choices=list(xla_flags.PRESETS),
                   help="XLA:CPU flags set before JAX starts: tuned (this project's measured "
                        "settings) or default (XLA's own); benchmarks/xla_flags.py")
    p.add_argument("--json", default=None, help="also write the results as JSON to this file")
    return p.parse_args(argv)


# (name, lhs shape, rhs shape, lhs contracting dim, rhs contracting dim, batched)
def shapes(b: int, t: int, d: int, f: int, h: int) -> list[tuple[str, tuple, tuple, int, int, bool]]:
    m, hd = b * t, d // h
    out = []
    for name, k, n in (("qkv", d, 3 * d), ("attn_out", d, d), ("mlp_fc1", d, f), ("mlp_fc2", f, d)):
        out += [(f"{name} fwd x@W", (m, k), (k, n), 1, 0, False),
                (f"{name} dx dy@W^T", (m, n), (k, n), 1, 1, False),
                (f"{name} dW x^T@dy", (m, k), (m, n), 0, 0, False)]
    bh = b * h
    out += [("attn q@k^T (fwd, bwd dP)", (bh, t, hd), (bh, t, hd), 2, 2, True),
            ("attn p@v (fwd, bwd dQ, dV, dK)", (bh, t, t), (bh, t, hd), 2, 1, True)]
    return out


def counts() -> dict[str, int]:
    """How often each product occurs per block in a train step."""
    return {"attn q@k^T (fwd, bwd dP)": 2, "attn p@v (fwd, bwd dQ, dV, dK)": 4}


def xla_runner(lhs: tuple, rhs: tuple, lc: int, rc: int, batched: bool) -> Callable[[], float]:
    a = jnp.asarray(np.random.default_rng(0).standard_normal(lhs, np.float32))
    b = jnp.asarray(np.random.default_rng(1).standard_normal(rhs, np.float32))
    dims = (((lc,), (rc,)), ((0,), (0,)) if batched else ((), ()))
    f = jax.jit(lambda x, y: jax.lax.dot_general(x, y, dims)).lower(a, b).compile(
        compiler_options=xla_flags.compiler_options())
    jax.block_until_ready(f(a, b))

    def run() -> float:
        t = time.perf_counter()
        jax.block_until_ready(f(a, b))
        return time.perf_counter() - t
    return run


def torch_runner(torch: Any, lhs: tuple, rhs: tuple, lc: int, rc: int,
                 batched: bool) -> Callable[[], float]:
    a = torch.randn(lhs)
    b = torch.randn(rhs)
    if batched:  # (bh, i, k) x (bh, k, j): move the contracting dims into place (views)
        x = a if lc == 2 else a.transpose(1, 2)
        y = b if rc == 1 else b.transpose(1, 2)
        op = lambda: torch.bmm(x, y)  # noqa: E731
    else:
        x = a if lc == 1 else a.t()
        y = b if rc == 0 else b.t()
        op = lambda: torch.mm(x, y)  # noqa: E731
    op()

    def run() -> float:
        t = time.perf_counter()
        op()
        return time.perf_counter() - t
    return run


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch = None
    if not args.no_torch:
        try:
            import torch  # type: ignore[no-redef]
        except ImportError:
            torch = None
    cfg = common.bench_config(args.model, "layernorm", image_size=args.image_size, batch=args.batch,
                              depth=args.depth)
    m = models.spec_of(cfg.model)
    grid = int(cfg.data.image_size) // m.patch_size
    t = grid * grid + 1
    depth = m.depth
    rows = []
    tot = {"xla": 0.0, "torch": 0.0}
    for name, lhs, rhs, lc, rc, batched in shapes(args.batch, t, m.hidden_size, m.mlp_dim,
                                                  m.num_heads):
        runners = {"xla": xla_runner(lhs, rhs, lc, rc, batched)}
        if torch is not None:
            runners["torch"] = torch_runner(torch, lhs, rhs, lc, rc, batched)
        times = common.interleaved(runners, args.repeats, warmup=1)
        n = counts().get(name, 1) * depth
        row: dict[str, Any] = {"product": name, "lhs": "x".join(map(str, lhs)),
                               "rhs": "x".join(map(str, rhs)), "per_step": n}
        for k, ts in times.items():
            med = common.summarize(ts).median
            row[f"{k}_ms"] = round(med * 1e3, 3)
            tot[k] += med * n
        if "torch" in times:
            row["xla/torch"] = round(row["xla_ms"] / row["torch_ms"], 2)
        rows.append(row)
    return {"machine": common.machine(), "args": vars(args), "rows": rows,
            "per_step_s": {k: v for k, v in tot.items() if v}, "torch": torch is not None}


def report(res: dict[str, Any]) -> str:
    a = res["args"]
    cols = ["product", "lhs", "rhs", "per_step", "xla_ms"] + (
        ["torch_ms", "xla/torch"] if res["torch"] else [])
    tot = res["per_step_s"]
    line = "matmul time per train step: " + ", ".join(f"{k} {v:.3f} s" for k, v in tot.items())
    if "torch" in tot:
        line += f" (xla/torch {tot['xla'] / tot['torch']:.2f})"
    return (f"matmuls of one train step: model={a['model']} batch={a['batch']}; median of "
            f"{a['repeats']} alternating\n" + common.table(res["rows"], cols) + "\n" + line)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    return common.run_entry(parse, run, report, argv)


if __name__ == "__main__":
    main()
