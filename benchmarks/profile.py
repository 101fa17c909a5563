"""Where a train step's time goes: a device trace of a few steps, summed per XLA op, grouped by
what the op does (matmul, attention's batched matmul, transpose/copy, reduction, elementwise) and
by the part of the model it comes from (from the op's source metadata).

    python -m benchmarks.profile --model=Ti/4 --norm=layernorm --batch=128 --steps=3

Times are the summed durations of the ops' trace events (on CPU: CPU time over all threads, so
with 2 threads busy they add to up to 2x the wall time), per step. Needs the XSpace protobuf
reader that TensorFlow ships (a dependency of this project).
"""
from __future__ import annotations

from benchmarks import xla_flags

xla_flags.apply()

import argparse  # noqa: E402
import collections  # noqa: E402
import glob  # noqa: E402
import re  # noqa: E402
import tempfile  # noqa: E402
from typing import Any, Sequence  # noqa: E402

import jax  # noqa: E402

from benchmarks import common  # noqa: E402
from normvit_jax import tool_flags  # noqa: E402

PARTS = (("optimizer", ("optax", "adam", "clip", "tree_norm", "apply_updates", "/scale_by")),
         ("norm", ("LayerNorm_", "encoder_norm", "PostNorm_", "patch_norm_")),
         ("attention", ("MultiHeadDotProductAttention",)), ("mlp", ("MlpBlock",)),
         ("embedding", ("embedding", "posembed")), ("head/loss", ("head", "softmax_cross", "log_softmax")))


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = tool_flags.Parser("python -m benchmarks.profile", __doc__)
    p.add_argument("--model", default="Ti/4")
    p.add_argument("--norm", default="layernorm", help=f"one of {list(common.NORMS)}")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--image_size", type=int, default=None)
    p.add_argument("--depth", type=int, default=None)
    p.add_argument("--attention_impl", default=None, choices=common.ATTENTION_IMPLS)
    p.add_argument("--top", type=int, default=15, help="list this many single ops")
    p.add_argument("--part", default=None,
                   help="list the top ops of this model part only ('each': the top of every part)")
    p.add_argument("--xla_preset", default=xla_flags.DEFAULT_PRESET, choices=list(xla_flags.PRESETS))
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def classify(hlo_text: str) -> dict[str, tuple[str, str]]:
    """Instruction name -> (kind, model part) for every instruction of the optimized HLO."""
    comps: dict[str, str] = {}
    for m in re.finditer(r"^%?([\w.\-]+) \([^\n]*\{\n(.*?)\n\}", hlo_text, re.S | re.M):
        comps[m.group(1)] = m.group(2)
    out: dict[str, tuple[str, str]] = {}
    for line in hlo_text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = \S+ ([\w\-]+)\(", line)
        if not m:
            continue
        name, op = m.groups()
        body = line
        call = re.search(r"calls=%?([\w.\-]+)", line)
        if call and call.group(1) in comps:
            body = comps[call.group(1)]
        if op == "dot" or " dot(" in body or " convolution(" in body:
            kind = "batched matmul" if "lhs_batch_dims" in (line if op == "dot" else body) else "matmul"
        elif op == "custom-call" or "ynn" in name or "xnn" in name:
            kind = "library call"
        elif re.search(r" (reduce|reduce-window)\(", body) or op in ("reduce", "reduce-window"):
            kind = "reduction"
        elif re.search(r" (transpose|copy)\(", body) or op in ("transpose", "copy"):
            kind = "transpose/copy"  # a layout change, with whatever elementwise work fused in
        elif op == "fusion":
            kind = "elementwise"
        else:
            kind = op
        src = " ".join(re.findall(r'op_name="([^"]+)"', body))
        part = next((p for p, keys in PARTS if any(k in src for k in keys)), "other")
        out[name] = (kind, part)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    overrides = {"attention_impl": args.attention_impl} if args.attention_impl else None
    cfg = common.bench_config(args.model, args.norm, image_size=args.image_size, batch=args.batch,
                              depth=args.depth, model_overrides=overrides)
    bench = common.compile_train(args.norm, cfg)
    hlo = bench.compiled.as_text()
    kinds = classify(hlo)
    shapes = dict(re.findall(r"^\s*%?([\w.\-]+) = (\S+) ", hlo, re.M))
    bench.step()
    bench.step()
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            wall = [bench.step() for _ in range(args.steps)]
        from tensorflow.tsl.profiler.protobuf import xplane_pb2
        space = xplane_pb2.XSpace()
        with open(glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0], "rb") as f:
            space.ParseFromString(f.read())
    per_op: collections.Counter = collections.Counter()
    for plane in space.planes:
        meta = plane.event_metadata
        for line in plane.lines:
            for ev in line.events:
                name = meta[ev.metadata_id].name
                if name in kinds:
                    per_op[name] += ev.duration_ps / 1e12 / args.steps
    by_kind: collections.Counter = collections.Counter()
    by_part: collections.Counter = collections.Counter()
    for name, t in per_op.items():
        kind, part = kinds[name]
        by_kind[kind] += t
        by_part[part] += t
    total = sum(per_op.values())
    rows_kind = [{"kind": k, "s_per_step": round(v, 3), "share": round(v / total, 3)}
                 for k, v in by_kind.most_common()]
    rows_part = [{"part": k, "s_per_step": round(v, 3), "share": round(v / total, 3)}
                 for k, v in by_part.most_common()]
    rows_top, taken = [], collections.Counter()
    for n, v in per_op.most_common():
        part = kinds[n][1]
        if args.part not in (None, "each", part):
            continue
        limit = args.top if args.part != "each" else max(1, args.top // len(by_part))
        if (taken[part] if args.part == "each" else len(rows_top)) >= limit:
            continue
        taken[part] += 1
        rows_top.append({"op": n, "kind": kinds[n][0], "part": part,
                         "ms_per_step": round(v * 1e3, 1), "shape": shapes.get(n, "")})
    return {"machine": common.machine(), "args": vars(args), "wall_s": common.summarize(wall).median,
            "op_time_s": total, "by_kind": rows_kind, "by_part": rows_part, "top": rows_top,
            "flops": bench.flops}


def report(res: dict[str, Any]) -> str:
    a = res["args"]
    head = (f"profile: model={a['model']} norm={a['norm']} batch={a['batch']}; wall "
            f"{res['wall_s']:.3f} s/step, op time {res['op_time_s']:.3f} s/step (all threads)")
    return "\n".join([head, common.table(res["by_kind"], ["kind", "s_per_step", "share"]),
                      common.table(res["by_part"], ["part", "s_per_step", "share"]),
                      common.table(res["top"], ["op", "kind", "part", "ms_per_step", "shape"])])


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    return common.run_entry(parse, run, report, argv)


if __name__ == "__main__":
    main()
