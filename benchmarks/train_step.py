"""Train-step benchmark: compile time, step time, images/s, FLOPs, MFU, memory; per normalizer.

    python -m benchmarks.train_step --model=S/16 --norm=dtn --batch=128 --dtype=bfloat16 --steps=50
    python -m benchmarks.train_step --model=Ti/4 --norm=all --batch=128 --steps=7

The step is the train loop's own (``steps.make_train_step``, jitted with the loop's shardings and
donated state) on a fixed synthetic batch. FLOPs come from XLA's cost analysis of the compiled
step; MFU is model FLOPs / time / peak, the peak given by ``--peak_tflops`` or measured with a
large matmul (then labelled 'probe'). With several norms every step is timed round-robin in one
process and each norm's time is reported as the median of its per-round ratio to LayerNorm's.
"""
from __future__ import annotations

from benchmarks import xla_flags

xla_flags.apply()

import sys  # noqa: E402
from typing import Any, Sequence  # noqa: E402

from benchmarks import common  # noqa: E402
from normvit_jax import tool_flags  # noqa: E402

SLACK = 0.05  # the target: time ratio <= FLOP ratio + SLACK


def parse(argv: Sequence[str] | None) -> tool_flags.Args:
    p = tool_flags.Parser("python -m benchmarks.train_step", __doc__)
    p.add_argument("--model", default="Ti/4", help="preset '<Ti|S|B|L|H>/<patch>'")
    p.add_argument("--norm", default="layernorm",
                   help=f"'all' or a comma list of {list(common.NORMS)}")
    p.add_argument("--batch", type=int, default=128, help="global batch")
    p.add_argument("--dtype", default="float32", choices=list(common.DTYPES))
    p.add_argument("--steps", type=int, default=10, help="timed steps (rounds) per norm")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps (rounds) first")
    p.add_argument("--image_size", type=int, default=None, help="default: 32 for patch<=8, else 224")
    p.add_argument("--depth", type=int, default=None, help="override the preset's depth")
    p.add_argument("--num_classes", type=int, default=10)
    p.add_argument("--remat", action="store_true", help="activation checkpointing per block")
    p.add_argument("--scan", action="store_true", help="nn.scan over blocks (model.scan)")
    p.add_argument("--grad_accum", type=int, default=1, help="config.grad_accum_steps")
    p.add_argument("--attention_impl", default=None, choices=common.ATTENTION_IMPLS)
    p.add_argument("--peak_tflops", type=float, default=None,
                   help="device peak for MFU; default: measured by a matmul probe")
    p.add_argument("--xla_preset", default=xla_flags.DEFAULT_PRESET, choices=list(xla_flags.PRESETS))
    p.add_argument("--json", default=None, help="also write the results here")
    return p.parse_args(argv)


def run(args: tool_flags.Args) -> dict[str, Any]:
    names = common.norm_names(args.norm)
    overrides = {"attention_impl": args.attention_impl} if args.attention_impl else None
    benches = {}
    for n in names:
        cfg = common.bench_config(args.model, n, image_size=args.image_size, batch=args.batch,
                                  dtype=args.dtype, remat=args.remat, scan=args.scan,
                                  grad_accum=args.grad_accum, num_classes=args.num_classes,
                                  depth=args.depth, model_overrides=overrides)
        benches[n] = common.compile_train(n, cfg, num_classes=args.num_classes)
        print(f"compiled {n}: {benches[n].compile_s:.1f} s", file=sys.stderr, flush=True)
    times = common.interleaved({n: b.step for n, b in benches.items()}, args.steps, args.warmup)
    if args.peak_tflops:
        peak, peak_src = args.peak_tflops * 1e12, "given"
    else:
        peak, peak_src = common.matmul_probe(common.DTYPES[args.dtype]), "probe"
    ratios = common.paired_ratios(times, "layernorm") if "layernorm" in benches else {}
    base_flops = benches["layernorm"].flops if "layernorm" in benches else None
    rows = []
    for n, b in benches.items():
        s = common.summarize(times[n])
        row: dict[str, Any] = {
            "norm": n, "compile_s": round(b.compile_s, 1), "step_s": s.fmt(), "step_median_s": s.median,
            "images_per_s": round(args.batch / s.median, 1),
            "gflops_per_step": None if b.flops is None else round(b.flops / 1e9, 2),
            "tflops_per_s": None if b.flops is None else round(b.flops / s.median / 1e12, 4),
            "mfu": None if b.flops is None else round(b.flops / s.median / peak, 4),
            "xla_peak_gib": common.gib(b.memory.get("xla_peak")),
        }
        if ratios and len(benches) > 1:
            r = ratios[n]
            row["time_ratio"] = r.fmt(digits=3)
            row["time_ratio_median"] = r.median
            if b.flops and base_flops:
                row["flop_ratio"] = round(b.flops / base_flops, 4)
                row["bound"] = round(b.flops / base_flops + SLACK, 4)
                row["within"] = "yes" if r.median <= row["bound"] else "NO"
        rows.append(row)
    device_peak = common.device_peak_bytes()
    return {"machine": common.machine(), "args": vars(args), "rows": rows, "times": times,
            "peak_flops": peak, "peak_source": peak_src,
            "device_peak_gib": common.gib(device_peak)}


def report(res: dict[str, Any]) -> str:
    a = res["args"]
    head = (f"train step: model={a['model']} image={a['image_size'] or 'default'} batch={a['batch']} "
            f"dtype={a['dtype']} remat={a['remat']} scan={a['scan']} grad_accum={a['grad_accum']}; "
            f"{a['steps']} timed rounds after {a['warmup']} warm-up; step time median [p25, p75] s; "
            f"peak {res['peak_flops'] / 1e12:.3f} TFLOP/s ({res['peak_source']})")
    cols = ["norm", "compile_s", "step_s", "images_per_s", "gflops_per_step", "mfu", "xla_peak_gib"]
    if any("time_ratio" in r for r in res["rows"]):
        cols += ["time_ratio", "flop_ratio", "bound", "within"]
    out = [head, common.table(res["rows"], cols)]
    if res["device_peak_gib"] is not None:
        out.append(f"device peak memory: {res['device_peak_gib']:.2f} GiB")
    else:
        out.append("device peak memory: not reported by this backend (xla_peak_gib: XLA's buffer "
                   "assignment, arguments + outputs + temporaries - donated)")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    return common.run_entry(parse, run, report, argv)


if __name__ == "__main__":
    main()
