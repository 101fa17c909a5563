"""Train-step benchmark: compile time, step time, images/s, FLOPs, MFU, memory; per normalizer.

    python -m benchmarks.train_step --model=S/16 --norm=dtn --batch=128 --dtype=bfloat16 --steps=50
    python -m benchmarks.train_step --model=Ti/4 --norm=all --batch=128 --steps=7
    python -m benchmarks.train_step --model=B/16 --norm=all --isolate --batch=256 --dtype=bfloat16

The step is the train loop's own (``steps.make_train_step``, jitted with the loop's shardings and
donated state) on a fixed synthetic batch. MFU is analytic model FLOPs (``benchmarks.model_flops``:
3x the forward's matrix products) / step time / peak; XLA's cost-analysis count is printed next to
it (on GPU it leaves out the cuBLAS/cuDNN calls). The peak is ``--peak_tflops``, else the
datasheet figure for the device (GPUs in ``model_flops.PEAK_TFLOPS``), else a large matmul's
measured rate ('probe'). With several norms every step is timed round-robin in one process and
each norm's time is reported as the median of its per-round ratio to LayerNorm's; with
``--isolate`` each norm runs in its own process (``benchmarks.isolate``, ``--norm_timeout``) and
the ratio is of the medians.
"""
from __future__ import annotations

from benchmarks import xla_flags

xla_flags.apply()

import argparse  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from typing import Any, Sequence  # noqa: E402

from benchmarks import common, isolate, model_flops  # noqa: E402
from normvit_jax import models, tool_flags  # noqa: E402
from normvit_jax.models.spec import RECOMPUTE, STREAM_LAYOUTS  # noqa: E402

SLACK = 0.05  # the target: time ratio <= FLOP ratio + SLACK
XLA_AGREES = 0.25  # XLA's count is used for the FLOP ratio only within 25% of the analytic one
DTN_NORMS = ("dtn", "dtn_var", "dtn_pallas")
NORM_TIMEOUT_S = 300.0  # --norm_timeout's default


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = tool_flags.Parser("python -m benchmarks.train_step", __doc__)
    p.add_argument("--model", default="Ti/4", help="preset '<Ti|S|B|L|H>/<patch>'")
    p.add_argument("--norm", default="layernorm",
                   help=f"'all' or a comma list of {list(common.NORMS)}")
    p.add_argument("--batch", type=tool_flags.positive_int, default=128, help="global batch")
    p.add_argument("--dtype", default="float32", choices=list(common.DTYPES),
                   help="compute dtype (parameters stay float32)")
    p.add_argument("--steps", type=tool_flags.positive_int, default=10,
                   help="timed steps (rounds) per norm")
    p.add_argument("--warmup", type=tool_flags.non_negative_int, default=2,
                   help="untimed steps (rounds) first")
    p.add_argument("--image_size", type=tool_flags.positive_int, default=None,
                   help="default: 32 for patch<=8, else 224")
    p.add_argument("--depth", type=tool_flags.positive_int, default=None, help="override the preset's depth")
    p.add_argument("--num_classes", type=tool_flags.positive_int, default=10, help="classes of the head")
    p.add_argument("--remat", action="store_true", help="activation checkpointing per block")
    p.add_argument("--scan", action="store_true", help="nn.scan over blocks (model.scan)")
    p.add_argument("--grad_accum", type=tool_flags.positive_int, default=1, help="config.grad_accum_steps")
    p.add_argument("--attention_impl", default=None, choices=common.ATTENTION_IMPLS,
                   help="model.attention_impl (default: the config's, auto)")
    p.add_argument("--recompute", default=None, choices=list(RECOMPUTE),
                   help="model.recompute (default: the config's, none)")
    p.add_argument("--stream_layout", default=None, choices=list(STREAM_LAYOUTS),
                   help="model.stream_layout (default: the config's, auto: pinned on GPU)")
    p.add_argument("--peak_tflops", type=float, default=None,
                   help="device peak for MFU; default: the datasheet's (GPUs), else a matmul probe")
    p.add_argument("--xla_preset", default=xla_flags.DEFAULT_PRESET, choices=list(xla_flags.PRESETS),
                   help="XLA:CPU flags set before JAX starts: tuned (this project's measured "
                        "settings) or default (XLA's own); benchmarks/xla_flags.py")
    p.add_argument("--isolate", action="store_true",
                   help="each norm in its own process (benchmarks.isolate); ratios of medians")
    p.add_argument("--norm_timeout", type=float, default=NORM_TIMEOUT_S,
                   help="with --isolate: seconds per norm before it is stopped and reported")
    p.add_argument("--isolate_dir", default=None,
                   help="with --isolate: per-norm logs and JSON (default: next to --json, or ./runs)")
    p.add_argument("--one_process", action="store_true",
                   help="the norms one after another in this process, each freed before the next "
                        "(benchmarks.one_process): no process start or import per norm; ratios of "
                        "medians; a norm's device peak where it can be told apart")
    p.add_argument("--ln_variants", default="",
                   help="with --one_process: 'NAME=--xla_flag=v ...;NAME2=...': LayerNorm compiled "
                        "again with these XLA flags as per-compile options, rows 'layernorm@NAME' "
                        "(an empty FLAGS is the plain LayerNorm row)")
    p.add_argument("--time_budget_s", type=float, default=None,
                   help="with --one_process: start no norm once this many seconds have passed "
                        "(the rest reported as skipped); the JSON is rewritten after every norm")
    p.add_argument("--interleave_rounds", type=int, default=0,
                   help="with --one_process: keep every norm's step on the device after its own "
                        "timing, then time them round-robin for this many rounds (rotating order, "
                        "one warm-up round): rows' interleaved_ratio, per round to LayerNorm's, "
                        "free of the drift between norms timed one after another")
    p.add_argument("--augment", default="none",
                   help="comma list of on-device augmentation sets, each timed beside the others "
                        f"(row '<norm>+<set>'): {sorted(AUGMENT)}")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    if (args.ln_variants or args.time_budget_s or args.interleave_rounds) and not args.one_process:
        raise SystemExit("--ln_variants, --time_budget_s and --interleave_rounds need "
                         "--one_process")
    if (args.isolate_dir or args.norm_timeout != NORM_TIMEOUT_S) and not args.isolate:
        raise SystemExit("--norm_timeout and --isolate_dir need --isolate")  # else ignored
    if args.isolate and args.one_process:  # --one_process ran and --isolate was dropped
        raise SystemExit("--isolate and --one_process: choose one")
    if args.peak_tflops is not None and not args.peak_tflops > 0:  # -1: a negative MFU column
        raise SystemExit(f"--peak_tflops={args.peak_tflops}: must be > 0 (omit it to probe)")
    if args.interleave_rounds < 0:
        raise SystemExit(f"--interleave_rounds={args.interleave_rounds}: must be >= 0 (0: off)")
    xla_flags.parse_variants(args.ln_variants, "ln_variants")
    bad = [a for a in args.augment.split(",") if a not in AUGMENT]
    if bad:
        raise SystemExit(f"--augment: unknown {bad}; accepted: {sorted(AUGMENT)}")
    return args


# The train step's on-device augmentation (train/batch_aug.py) as DeiT's recipe sets it
# (configs/recipes.py), whole or RandAugment alone; what it costs the step is this row's ratio.
AUGMENT = {
    "none": {},
    "randaugment": {"randaugment": "rand-m9-mstd0.5-inc1"},
    "deit": {"randaugment": "rand-m9-mstd0.5-inc1", "mixup_alpha": 0.8, "cutmix_alpha": 1.0,
             "mix_prob": 1.0, "switch_prob": 0.5, "random_erase_prob": 0.25,
             "random_erase_mode": "pixel"},
}


def analytic_flops(args: argparse.Namespace, cfg: Any, norm: str) -> tuple[float, float]:
    """(ViT model FLOPs per step, the same + the norm's own matrix products) for MFU and ratios."""
    shape = model_flops.shape_from_spec(models.spec_of(cfg.model), int(cfg.data.image_size),
                                        args.num_classes)
    vit = model_flops.train_step_flops(shape, args.batch)
    extra = 0.0
    if norm in DTN_NORMS:  # every norm slot: 2 per block + the final norm
        extra = model_flops.dtn_statistics_flops(shape, 2 * shape.depth + 1)
    return vit, model_flops.train_step_flops(shape, args.batch, extra)


def peak(args: argparse.Namespace) -> tuple[float, str]:
    if args.peak_tflops:
        return args.peak_tflops * 1e12, "given"
    import jax
    kind = jax.devices()[0].device_kind
    table = model_flops.peak_tflops(kind, args.dtype) if jax.default_backend() == "gpu" else None
    if table:
        return table * 1e12, f"datasheet {kind}"
    return common.matmul_probe(common.DTYPES[args.dtype]), "probe"


def run(args: argparse.Namespace) -> dict[str, Any]:
    names = common.norm_names(args.norm)
    if args.isolate and len(names) > 1 and not args.one_process:
        return run_isolated(args, names)
    if args.one_process:
        from benchmarks import one_process
        return one_process.run(args, names)
    benches, flops = {}, {}
    for norm in names:
        for aug in args.augment.split(","):
            n = norm if aug == "none" else f"{norm}+{aug}"
            cfg = config(args, norm, aug)
            flops[n] = analytic_flops(args, cfg, norm)
            benches[n] = common.compile_train(n, cfg, num_classes=args.num_classes)
            print(f"compiled {n}: {benches[n].compile_s:.1f} s", file=sys.stderr, flush=True)
    times = common.interleaved({n: b.step for n, b in benches.items()}, args.steps, args.warmup)
    peak_flops, peak_src = peak(args)
    rows = [row(args, b, times[n], flops[n], peak_flops) for n, b in benches.items()]
    if len(benches) > 1 and "layernorm" in benches:
        add_ratios(rows, common.paired_ratios(times, "layernorm"))
    device_peak = common.device_peak_bytes()
    return {"machine": common.machine(), "args": vars(args), "rows": rows, "times": times,
            "peak_flops": peak_flops, "peak_source": peak_src,
            "device_peak_gib": common.gib(device_peak)}


def config(args: argparse.Namespace, norm: str, aug: str = "none") -> Any:
    """The benchmark config of one norm (and on-device augmentation set) from the flags."""
    overrides = {k: getattr(args, k) for k in ("attention_impl", "recompute", "stream_layout")
                 if getattr(args, k)} or None
    cfg = common.bench_config(args.model, norm, image_size=args.image_size, batch=args.batch,
                              dtype=args.dtype, remat=args.remat, scan=args.scan,
                              grad_accum=args.grad_accum, num_classes=args.num_classes,
                              depth=args.depth, model_overrides=overrides)
    cfg.update(AUGMENT[aug])
    return cfg


def row(args: argparse.Namespace, b: common.TrainBench, times: list[float],
        flops: tuple[float, float], peak_flops: float) -> dict[str, Any]:
    """One norm's report row from its compiled step and timed steps."""
    s = common.summarize(times)
    vit, with_norm = flops
    return {"norm": b.name, "compile_s": round(b.compile_s, 1), "init_s": round(b.init_s, 1),
            "step_s": s.fmt(),
            "step_median_s": s.median, "images_per_s": round(args.batch / s.median, 1),
            "model_gflops": vit / 1e9, "norm_gflops": (with_norm - vit) / 1e9,
            "xla_gflops": None if b.flops is None else b.flops / 1e9,
            "mfu": round(model_flops.mfu(vit, s.median, peak_flops), 4),
            "xla_peak_gib": common.gib(b.memory.get("xla_peak"))}


def add_ratios(rows: list[dict[str, Any]], ratios: dict[str, common.Summary]) -> None:
    """Time ratio to LayerNorm's next to the FLOP ratio and its bound. FLOPs: XLA's counts where
    both agree with the analytic ones (CPU), else the analytic ones with the norm's products."""
    base = next(r for r in rows if r["norm"] == "layernorm")
    use_xla = all(r.get("xla_gflops") and abs(r["xla_gflops"] / (r["model_gflops"] + r["norm_gflops"])
                                               - 1) <= XLA_AGREES for r in rows)
    total = (lambda r: r["xla_gflops"]) if use_xla else (lambda r: r["model_gflops"] + r["norm_gflops"])
    for r in rows:
        ratio = ratios[r["norm"]]
        r["time_ratio"] = ratio.fmt(digits=3)
        r["time_ratio_median"] = ratio.median
        r["flop_ratio"] = round(total(r) / total(base), 4)
        r["flop_source"] = "xla" if use_xla else "analytic"
        if "+" in r["norm"] or "@" in r["norm"]:  # augmentation / XLA flag variant: no bound
            r["bound"], r["within"] = None, "-"
            continue
        r["bound"] = round(r["flop_ratio"] + SLACK, 4)
        r["within"] = "yes" if ratio.median <= r["bound"] else "NO"


def child_argv(args: argparse.Namespace, norm: str, json_path: str) -> list[str]:
    """This run's flags for one norm in its own process."""
    out = [f"--model={args.model}", f"--norm={norm}", f"--batch={args.batch}",
           f"--dtype={args.dtype}", f"--steps={args.steps}", f"--warmup={args.warmup}",
           f"--num_classes={args.num_classes}", f"--grad_accum={args.grad_accum}",
           f"--xla_preset={args.xla_preset}", f"--augment={args.augment}",
           f"--json={json_path}"]
    for flag in ("image_size", "depth", "attention_impl", "recompute", "stream_layout",
                 "peak_tflops"):
        if getattr(args, flag) is not None:
            out.append(f"--{flag}={getattr(args, flag)}")
    out += [f"--{flag}" for flag in ("remat", "scan") if getattr(args, flag)]
    return out


def run_isolated(args: argparse.Namespace, names: list[str]) -> dict[str, Any]:
    """One process per norm; failures and timeouts are reported, the others still measured. The
    time ratio is the ratio of medians from separate processes (no per-round pairing)."""
    out_dir = args.isolate_dir or os.path.join(
        os.path.dirname(os.path.abspath(args.json)) if args.json else "runs", "train_step_isolated")
    outcomes = isolate.run_isolated(names, lambda n, j: child_argv(args, n, j),
                                    "benchmarks.train_step", out_dir, args.norm_timeout)
    rows, times, failures, first = [], {}, [], None
    for o in outcomes:
        if o.status != "ok":
            failures.append({"norm": o.name, "status": o.status, "reason": o.reason, "log": o.log})
            continue
        first = first or o.result
        for r in o.result["rows"]:  # the norm, and with --augment its '<norm>+<set>' rows
            rows.append(dict(r, device_peak_gib=o.result.get("device_peak_gib"),
                             wall_s=round(o.seconds, 1)))
            times[r["norm"]] = o.result["times"][r["norm"]]
    if any(r["norm"] == "layernorm" for r in rows) and len(rows) > 1:
        base = common.summarize(times["layernorm"])
        add_ratios(rows, {n: _ratio_of_medians(common.summarize(ts), base) for n, ts in times.items()})
    return {"machine": (first or {}).get("machine", {}), "args": vars(args), "rows": rows,
            "times": times, "failures": failures,
            "peak_flops": (first or {}).get("peak_flops", float("nan")),
            "peak_source": (first or {}).get("peak_source", "-"),
            "device_peak_gib": max((r["device_peak_gib"] for r in rows
                                    if r.get("device_peak_gib") is not None), default=None)}


def _ratio_of_medians(s: common.Summary, base: common.Summary) -> common.Summary:
    """median/median, the quartiles as p25/p75 over base's median (an indication of spread)."""
    return common.Summary(s.median / base.median, s.lo / base.median, s.hi / base.median, s.n)


def report(res: dict[str, Any]) -> str:
    a = res["args"]
    how = ("one norm after another in one process, ratio of medians" if a.get("one_process") else
           "one process per norm, ratio of medians" if a.get("isolate") and len(res["rows"]) > 1
           else "round-robin in one process")
    head = (f"train step: model={a['model']}{common.depth_label(a)} "
            f"image={a['image_size'] or 'default'} batch={a['batch']} "
            f"dtype={a['dtype']} remat={a['remat']} recompute={a.get('recompute') or 'none'} "
            f"stream_layout={a.get('stream_layout') or 'auto'} "
            f"scan={a['scan']} grad_accum={a['grad_accum']}; "
            f"{a['steps']} timed rounds after {a['warmup']} warm-up ({how}); step time median "
            f"[p25, p75] s; MFU from analytic model FLOPs; peak {res['peak_flops'] / 1e12:.3f} "
            f"TFLOP/s ({res['peak_source']})")
    cols = ["norm", "compile_s", "step_s", "images_per_s", "model_gflops", "xla_gflops", "mfu",
            "xla_peak_gib"]
    if any("device_peak_gib" in r for r in res["rows"]):
        cols.append("device_peak_gib")
    if any("device_peak_le_gib" in r for r in res["rows"]):
        cols.append("device_peak_le_gib")
    if any("time_ratio" in r for r in res["rows"]):
        cols += ["time_ratio", "flop_ratio", "bound", "within"]
    if any("interleaved_ratio" in r for r in res["rows"]):
        cols.append("interleaved_ratio")
    out = [head, common.table(res["rows"], cols)]
    if res.get("interleaved_skipped"):
        out.append(f"interleaved rounds not measured: {res['interleaved_skipped']}")
    for f in res.get("failures", []):
        out.append(f"NOT MEASURED {f['norm']}: {f['status']}: {f['reason']} (log: {f['log']})")
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
