"""FSDP (``config.mesh.fsdp``) against replicated state: memory per device and step time.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
        python -m benchmarks.fsdp --models=B/16,L/16,H/14 --fsdp=8 --step_model=Ti/4

Memory: the loop's train step is compiled for abstract inputs (``common.lower_abstract_train_step``;
nothing is allocated) with fsdp=1 and fsdp=N over all devices, and XLA's buffer assignment of the
per-device program gives the state's bytes (arguments: params, optimizer moments, the batch shard)
and the step's peak (arguments + outputs + temporaries - donated aliases). Step time: a small
model's step, both meshes compiled in one process and timed round-robin (``common.interleaved``);
on CPU-simulated devices this measures the extra collectives' cost, not a real interconnect.
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
    p = tool_flags.Parser("python -m benchmarks.fsdp", __doc__)
    p.add_argument("--models", default="B/16,L/16,H/14", help="memory rows ('' for none)")
    p.add_argument("--fsdp", type=int, default=0, help="FSDP size (0: all devices)")
    p.add_argument("--batch_per_device", type=tool_flags.positive_int, default=1,
                   help="images per device (the global batch: this x the device count)")
    p.add_argument("--norm", default="layernorm", help=f"one of {list(common.NORMS)}")
    p.add_argument("--dtype", default="float32", choices=list(common.DTYPES),
                   help="compute dtype (parameters stay float32)")
    p.add_argument("--num_classes", type=tool_flags.positive_int, default=1000, help="classes of the head")
    p.add_argument("--depth", type=tool_flags.positive_int, default=None,
                   help="blocks of every model (default: the model's own; fewer compile faster)")
    p.add_argument("--image_size", type=tool_flags.positive_int, default=None,
                   help="default: 32 for patch sizes up to 8, else 224")
    p.add_argument("--step_model", default="Ti/4", help="step-time model ('' for none)")
    p.add_argument("--step_batch", type=tool_flags.positive_int, default=64,
                   help="global batch of the step timing")
    p.add_argument("--steps", type=tool_flags.positive_int, default=10, help="timed rounds")
    p.add_argument("--xla_preset", default=xla_flags.DEFAULT_PRESET, choices=list(xla_flags.PRESETS),
                   help="XLA:CPU flags set before JAX starts: tuned (this project's measured "
                        "settings) or default (XLA's own); benchmarks/xla_flags.py")
    p.add_argument("--json", default=None, help="also write the results as JSON to this file")
    args = p.parse_args(argv)
    common.check_norm(args.norm)  # was a KeyError traceback
    return args


def _config(model: str, args: argparse.Namespace, batch: int, fsdp: int, num_classes: int) -> Any:
    cfg = common.bench_config(model, args.norm, batch=batch, dtype=args.dtype,
                              num_classes=num_classes, depth=args.depth,
                              image_size=args.image_size)
    cfg.mesh.fsdp = fsdp
    return cfg


def memory_row(model: str, args: argparse.Namespace, fsdp: int) -> dict[str, Any]:
    batch = args.batch_per_device * jax.device_count()
    cfg = _config(model, args, batch, fsdp, args.num_classes)
    lowered, state = common.lower_abstract_train_step(cfg, args.num_classes)
    m = common.memory_stats(lowered.compile(compiler_options=xla_flags.compiler_options()))
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))
    g = lambda k: round(m[k] / 2 ** 30, 3) if k in m else None  # noqa: E731
    return {"model": model, "fsdp": fsdp, "params_M": round(n_params / 1e6, 1),
            "arguments_GiB": g("arguments"), "temp_GiB": g("temp"), "peak_GiB": g("xla_peak")}


def step_times(args: argparse.Namespace, fsdp: int) -> dict[str, Any]:
    benches = {f"fsdp={f}": common.compile_train(f"fsdp={f}", _config(
        args.step_model, args, args.step_batch, f, 10)) for f in (1, fsdp)}
    times = common.interleaved({n: b.step for n, b in benches.items()}, args.steps, warmup=2)
    ratios = common.paired_ratios(times, "fsdp=1")
    return {n: {"step_ms": common.summarize(t).fmt(1e3, 2), "vs_fsdp1": ratios[n].fmt(1, 3),
                "compile_s": round(benches[n].compile_s, 1)} for n, t in times.items()}


def run(args: argparse.Namespace) -> dict[str, Any]:
    fsdp = args.fsdp or jax.device_count()
    rows = []
    for model in [x.strip() for x in args.models.split(",") if x.strip()]:
        for f in (1, fsdp):
            rows.append(memory_row(model, args, f))
            print(rows[-1], file=sys.stderr, flush=True)
    steps = step_times(args, fsdp) if args.step_model else {}
    return {"machine": common.machine(), "args": vars(args), "rows": rows, "steps": steps}


def report(res: dict[str, Any]) -> str:
    a = res["args"]
    out = [f"memory per device (train step, norm={a['norm']}, dtype={a['dtype']}, "
           f"{a['batch_per_device']} image(s) per device; XLA buffer assignment on "
           f"{res['machine']['backend']}, {res['machine']['devices']})",
           common.table(res["rows"], ["model", "fsdp", "params_M", "arguments_GiB", "temp_GiB",
                                      "peak_GiB"])]
    if res["steps"]:
        out += [f"\nstep time of {a['step_model']} (global batch {a['step_batch']}; median "
                "[25%, 75%] over rounds)",
                common.table([{"mesh": n, **v} for n, v in res["steps"].items()],
                             ["mesh", "step_ms", "vs_fsdp1", "compile_s"])]
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    return common.run_entry(parse, run, report, argv)


if __name__ == "__main__":
    main()
