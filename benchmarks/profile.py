"""Where a train step's time goes: a device trace of a few steps, summed per XLA op, grouped by
what the op does (matmul, attention's batched matmul, transpose/copy, reduction, elementwise) and
by the part of the model it comes from (from the op's source metadata).

    python -m benchmarks.profile --model=Ti/4 --norm=layernorm --batch=128 --steps=3

Times are the summed durations of the ops' trace events per step: on a GPU the device's "XLA Ops"
line (kernels of one op summed; else the stream lines' kernels by their ``hlo_op``), so they add
up to the device's busy time; on CPU, CPU time over all threads (with 2 threads busy up to 2x the
wall time). The trace (``jax.profiler.trace``'s ``.xplane.pb``) is read with jaxlib's own reader
(``jax.profiler.ProfileData``): no TensorFlow, xprof or TensorBoard needed, so it runs on the GPU
host as it is. ``--trace_dir`` keeps the trace (open it in TensorBoard/xprof or Perfetto).
"""
from __future__ import annotations

from benchmarks import xla_flags

xla_flags.apply()

import argparse  # noqa: E402
import collections  # noqa: E402
import glob  # noqa: E402
import os  # noqa: E402
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
    p.add_argument("--model", default="Ti/4", help="ViT preset '<size>/<patch>', e.g. Ti/4, S/16")
    p.add_argument("--norm", default="layernorm", help=f"one of {list(common.NORMS)}")
    p.add_argument("--batch", type=tool_flags.positive_int, default=128, help="global batch")
    p.add_argument("--dtype", default="float32", choices=list(common.DTYPES),
                   help="compute dtype (parameters stay float32)")
    p.add_argument("--num_classes", type=tool_flags.positive_int, default=10, help="classes of the head")
    p.add_argument("--steps", type=tool_flags.positive_int, default=3, help="profiled steps")
    p.add_argument("--image_size", type=tool_flags.positive_int, default=None,
                   help="input resolution (default: 32 for a patch of at most 8, else 224)")
    p.add_argument("--depth", type=tool_flags.positive_int, default=None,
                   help="transformer blocks (default: the model preset's)")
    p.add_argument("--attention_impl", default=None, choices=common.ATTENTION_IMPLS,
                   help="model.attention_impl (default: the config's, auto)")
    p.add_argument("--top", type=tool_flags.positive_int, default=15, help="list this many single ops")
    p.add_argument("--part", default=None,
                   help="list the top ops of this model part only ('each': the top of every part)")
    p.add_argument("--xla_preset", default=xla_flags.DEFAULT_PRESET, choices=list(xla_flags.PRESETS),
                   help="XLA:CPU flags set before JAX starts: tuned (this project's measured "
                        "settings) or default (XLA's own); benchmarks/xla_flags.py")
    p.add_argument("--trace_dir", default=None,
                   help="keep the trace here (default: a temporary folder, removed)")
    p.add_argument("--json", default=None, help="also write the results as JSON to this file")
    args = p.parse_args(argv)
    common.check_norm(args.norm)  # one norm; was a KeyError (also for a comma list)
    parts = [name for name, _ in PARTS] + ["other", "each"]
    if args.part is not None and args.part not in parts:  # else an empty list of top ops
        p.error(f"--part: unknown {args.part!r}; accepted: one of {parts}")
    return args


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
        elif op == "custom-call":
            kind = custom_call_kind(line)
        elif "ynn" in name or "xnn" in name:
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


def custom_call_kind(line: str) -> str:
    """A custom call by its target: cuBLAS/cuBLASLt GEMMs (batched when the backend config has
    batch dimensions), cuDNN convolutions (the patch embedding), fused attention (cuDNN)."""
    m = re.search(r'custom_call_target="([^"]+)"', line)
    target = m.group(1).lower() if m else ""
    if "fmha" in target or "flash" in target or "attention" in target:
        return "attention (fused)"
    if "gemm" in target or "matmul" in target:
        return "batched matmul" if re.search(r'"lhs_batch_dimensions":\["\d', line) else "matmul"
    if "conv" in target:
        return "matmul"
    return "library call"


def _op_name(name: str) -> str:
    return name.lstrip("%").split(" ", 1)[0]


def op_times(profile: Any, kinds: dict[str, Any]) -> tuple[collections.Counter, float | None]:
    """(seconds per HLO op over the trace, seconds of device op events not matched to an op;
    None on CPU, whose threads also run non-op events).
    GPU: the device planes' 'XLA Ops' lines, else their stream lines by the 'hlo_op' stat; CPU:
    every thread's events named like an op."""
    per_op: collections.Counter = collections.Counter()
    unmatched = 0.0
    gpus = [p for p in profile.planes if p.name.startswith("/device:GPU")]
    for plane in gpus or profile.planes:
        lines = list(plane.lines)
        if gpus:
            ops = [ln for ln in lines if ln.name == "XLA Ops"]
            lines = ops or [ln for ln in lines if ln.name.startswith("Stream")]
        for line in lines:
            for ev in line.events:
                name = ev.name
                if gpus and line.name != "XLA Ops":
                    name = str(dict(ev.stats).get("hlo_op", name))
                name = _op_name(name)
                if name in kinds:
                    per_op[name] += ev.duration_ns / 1e9
                elif gpus:
                    unmatched += ev.duration_ns / 1e9
    return per_op, (unmatched if gpus else None)


def run(args: argparse.Namespace) -> dict[str, Any]:
    overrides = {"attention_impl": args.attention_impl} if args.attention_impl else None
    cfg = common.bench_config(args.model, args.norm, image_size=args.image_size, batch=args.batch,
                              dtype=args.dtype, num_classes=args.num_classes, depth=args.depth,
                              model_overrides=overrides)
    bench = common.compile_train(args.norm, cfg, num_classes=args.num_classes)
    hlo = bench.compiled.as_text()
    kinds = classify(hlo)
    shapes = dict(re.findall(r"^\s*%?([\w.\-]+) = (\S+) ", hlo, re.M))
    bench.step()
    bench.step()
    with tempfile.TemporaryDirectory() as tmp:
        d = args.trace_dir or tmp
        os.makedirs(d, exist_ok=True)
        with jax.profiler.trace(d):
            wall = [bench.step() for _ in range(args.steps)]
        path = sorted(glob.glob(f"{d}/**/*.xplane.pb", recursive=True), key=os.path.getmtime)[-1]
        trace = jax.profiler.ProfileData.from_file(path)
        planes = [p.name for p in trace.planes]
        per_op, unmatched = op_times(trace, kinds)
    per_op = collections.Counter({n: t / args.steps for n, t in per_op.items()})
    if not per_op:
        raise SystemExit("no event of the trace is an op of the compiled step (on a GPU: is "
                         f"CUPTI, the device tracer, installed?); its planes: {planes}")
    by_kind: collections.Counter = collections.Counter()
    by_part: collections.Counter = collections.Counter()
    for name, t in per_op.items():
        kind, part = kinds[name]
        by_kind[kind] += t
        by_part[part] += t
    total = sum(per_op.values())
    rows_kind = [{"kind": k, "s_per_step": round(v, 6), "share": round(v / total, 3)}
                 for k, v in by_kind.most_common()]
    rows_part = [{"part": k, "s_per_step": round(v, 6), "share": round(v / total, 3)}
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
                         "ms_per_step": ms(v), "shape": shapes.get(n, "")})
    return {"machine": common.machine(), "args": vars(args), "wall_s": common.summarize(wall).median,
            "op_time_s": total, "unmatched_s": None if unmatched is None else unmatched / args.steps,
            "matched_share": None if unmatched is None else
            round(total / max(total + unmatched / args.steps, 1e-12), 4),
            "by_kind": rows_kind, "by_part": rows_part, "top": rows_top,
            "flops": bench.flops}


def ms(seconds: float) -> float:
    """Milliseconds to 3 significant digits: a GPU step's ops are mostly 0.01-0.1 ms, which one
    decimal rounded to 0.0 or 0.1."""
    return float(f"{seconds * 1e3:.3g}")


def report(res: dict[str, Any]) -> str:
    a = res["args"]
    head = (f"profile: model={a['model']}{common.depth_label(a)} norm={a['norm']} "
            f"batch={a['batch']} dtype={a['dtype']}; "
            f"wall {res['wall_s']:.3f} s/step, op time {res['op_time_s']:.3f} s/step (device ops, "
            "or CPU time of all threads)")
    if res.get("unmatched_s"):
        head += (f"; {res['unmatched_s']:.4f} s/step of device op events matched no HLO op "
                 f"({res['matched_share']:.1%} matched)")
    return "\n".join([head, common.table(res["by_kind"], ["kind", "s_per_step", "share"]),
                      common.table(res["by_part"], ["part", "s_per_step", "share"]),
                      common.table(res["top"], ["op", "kind", "part", "ms_per_step", "shape"])])


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    return common.run_entry(parse, run, report, argv)


if __name__ == "__main__":
    main()
