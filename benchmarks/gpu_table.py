"""The GPU table of docs/benchmarks.md in one command.

    python -m benchmarks.gpu_table --out=runs/gpu              # on the GPU host
    python -m benchmarks.gpu_table --out=runs/gpu --dry-run    # print the commands only
    python -m benchmarks.gpu_table --out=/tmp/t --tiny         # CPU smoke test, tiny model
    python -m benchmarks.gpu_table --quick --out=runs/gpu      # issues 32/33 in <= --budget_s

``--quick`` (benchmarks/gpu_quick.py, docs/benchmarks.md "The quick run") measures B/16 and S/16
LayerNorm, DTN, RepBN and the progressive norms, timm eager/compiled, and each norm layer alone,
under one deadline; the rest of this docstring is the full run.

Runs, per model, ``benchmarks.train_step --isolate`` (every norm in its own process, with a
per-norm timeout) and ``benchmarks.vs_torch`` (timm eager and torch.compile on the same GPU), then
``benchmarks.input_pipeline --cores=1,2,4,...`` (the host's ImageNet JPEG pipeline by core count),
each as a subprocess under a timeout with its log written as it runs (``<out>/*.log``); then writes
the markdown (machine, versions, date; step time, images/s, analytic MFU, peak memory, ratio to
LayerNorm per norm; this project against timm eager and compiled; the pipeline's images/s by
cores against the fastest LayerNorm step's) to ``<out>/gpu_table.md`` and
between the markers ``<!-- gpu-table:begin -->`` / ``<!-- gpu-table:end -->`` of ``--doc``.
A command that fails or times out is reported in the table and the others still run.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import shutil
import sys
import tempfile
from typing import Any, Sequence

from benchmarks import files, isolate
from benchmarks.gpu_render import _f  # one number format for both tables
from normvit_jax import cli, tool_flags
from normvit_jax.data import pipeline as pipeline_lib

BEGIN, END = "<!-- gpu-table:begin -->", "<!-- gpu-table:end -->"


def _dict_keys(path: str, name: str) -> list[str]:
    """The keys of the literal dict assigned to ``name`` at the top of the file ``path``."""
    import ast
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else (
            node.targets[0] if isinstance(node, ast.Assign) else None)
        if isinstance(target, ast.Name) and target.id == name and isinstance(node.value, ast.Dict):
            return [k.value for k in node.value.keys]
    raise RuntimeError(f"{path} has no dict {name}")


def benchmark_norms() -> tuple[list[str], list[str]]:
    """(``benchmarks.common.NORMS``'s names, its ``REGISTRY_ONLY``), read from the two files'
    dicts, not imported (benchmarks.common imports jax): the norms of ``--norm=all``, and the
    names ``--norm`` accepts."""
    here = os.path.dirname(os.path.abspath(__file__))
    listed = _dict_keys(os.path.join(here, "common.py"), "NORMS")
    registry = os.path.join(os.path.dirname(here), "normvit_jax", "norms", "registry.py")
    extra = [n for n in sorted(_dict_keys(registry, "_ENTRIES")) if n not in listed]
    return listed + extra, extra


NORM_NAMES, REGISTRY_ONLY = benchmark_norms()
N_NORMS = len(NORM_NAMES)  # the timeout budget's norm count of --norm=all
# benchmarks.norm_kernels' rows: these, and the registry-only norms that --norm runs
KERNEL_NORMS = "layernorm,batchnorm,repbn,progressive,zscore_repbn,zscore,dyt,derf"
TINY_NORMS = "layernorm,rmsnorm"  # --tiny without --norm
# The XLA GPU flags worth a try (docs/benchmarks.md); pass any of them with --xla_flags.
GPU_FLAGS_TO_TRY = ("--xla_gpu_enable_latency_hiding_scheduler=true",
                    "--xla_gpu_enable_triton_gemm=false", "--xla_gpu_autotune_level=4")


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = tool_flags.Parser("python -m benchmarks.gpu_table", __doc__)
    p.add_argument("--out", default="runs/gpu", help="logs, JSON results and gpu_table.md")
    p.add_argument("--models", default="B/16,S/16",
                   help="comma list of ViT presets '<size>/<patch>'")
    p.add_argument("--norm", default=None,
                   help=f"train_step --norm: 'all' (default; --tiny: {TINY_NORMS}) or a comma list "
                        f"of {NORM_NAMES}")
    p.add_argument("--batch", type=tool_flags.positive_int, default=256, help="global batch")
    p.add_argument("--dtype", default="bfloat16", help="compute dtype (parameters stay float32)")
    p.add_argument("--steps", type=tool_flags.positive_int, default=None,
                   help="timed steps per run (default: 20; --quick: 10; --tiny: 1)")
    p.add_argument("--warmup", type=tool_flags.non_negative_int, default=None,
                   help="untimed steps first (default: 3; --quick: 2; --tiny: 0)")
    p.add_argument("--num_classes", type=tool_flags.positive_int, default=1000, help="classes of the head")
    p.add_argument("--norm_timeout", type=float, default=300.0, help="seconds per norm")
    p.add_argument("--torch_timeout", type=float, default=900.0, help="seconds per vs_torch run")
    p.add_argument("--no_torch", action="store_true", help="skip vs_torch")
    p.add_argument("--pipeline_cores", default=None,
                   help="input_pipeline --cores (default: 1, 2, 4, ... up to this host's cores; "
                        "'' skips it)")
    p.add_argument("--pipeline_timeout", type=float, default=900.0,
                   help="seconds allowed to each input-pipeline measurement")
    p.add_argument("--xla_flags", default="", help="appended to XLA_FLAGS of every run")
    p.add_argument("--doc", default=None,
                   help="markdown file to update between the markers (default: docs/benchmarks.md; "
                        "with --tiny: none)")
    p.add_argument("--dry-run", dest="dry_run", action="store_true", help="print the commands only")
    p.add_argument("--tiny", action="store_true",
                   help="Ti/4, depth 1, 8x8 images, batch 4, LN and RMSNorm, 1 step: a CPU smoke "
                        "test (with --quick: Ti/8 and Ti/4 stand in for B/16 and S/16, 16x16 "
                        "images, depth 1)")
    q = p.add_argument_group("--quick (benchmarks/gpu_quick.py)")
    q.add_argument("--quick", action="store_true",
                   help="issues 32/33's GPU figures within --budget_s: B/16 LN+DTN, S/16 "
                        "LN+RepBN+progressive+z-score->RepBN (each model's norms in one process), "
                        "timm eager/compiled for both models in one process, norm_kernels at B/16; "
                        "--models, --norm, the augmentation and input-pipeline runs do not apply")
    q.add_argument("--budget_s", type=float, default=480.0,
                   help="--quick: one deadline for every part, each stopped at its share")
    q.add_argument("--variants", default="",
                   help="--quick: extra LayerNorm rows compiled with other XLA flags, e.g. "
                        "'lhs=--xla_gpu_enable_latency_hiding_scheduler=true;"
                        "cublas=--xla_gpu_enable_triton_gemm=false' (rows layernorm@NAME; "
                        "'NAME=' with no flags is the plain row, already there)")
    q.add_argument("--isolate_norms", action="store_true",
                   help="--quick: each norm of the train parts in its own process with its own "
                        "share (a process start each) instead of a model's norms in one process")
    q.add_argument("--profile", action="store_true",
                   help="--quick: also profile one B/16 LN step (benchmarks.profile), last")
    q.add_argument("--compile_cache", default=None,
                   help="--quick: JAX persistent compilation cache shared by the parts (default: "
                        "a new temporary folder, removed at the end, kept out of --out; '' turns "
                        "it off)")
    # models.spec.RECOMPUTE, written out: this parent process does not import JAX
    q.add_argument("--recompute", default="none", choices=["none", "gelu"],
                   help="--quick: also the B/16 and S/16 LayerNorm steps with this model.recompute, "
                        "each in its own process (parts train_B16_recompute, train_S16_recompute)")
    # models.spec.STREAM_LAYOUTS, written out likewise
    q.add_argument("--stream_layout", default="auto", choices=["auto", "row_major", "free"],
                   help="--quick: also the B/16 and S/16 LayerNorm steps with this "
                        "model.stream_layout, each in its own process (parts train_B16_stream, "
                        "train_S16_stream): 'free' is the step before the stream was pinned")
    q.add_argument("--parts", default="",
                   help="--quick: only these parts, comma-separated (vs_torch, train_B16, "
                        "train_S16, norm_kernels, profile; a train part's name also selects its "
                        "per-norm parts under --isolate_norms), to split the run over two calls")
    args = p.parse_args(argv)
    if not args.quick:  # the full run would ignore them without a word
        given = [f"--{a.dest}" for a in q._group_actions
                 if a.dest != "quick" and getattr(args, a.dest) != a.default]
        if given:
            p.error(f"{', '.join(given)}: appl{'y' if len(given) > 1 else 'ies'} to --quick only")
    from benchmarks import xla_flags
    try:
        xla_flags.parse_variants(args.variants)
    except SystemExit as e:  # its bare message exited 1 without the tool's name
        msg = str(e.code)
        p.error(msg if msg.startswith("--variants") else f"--variants: {msg}")
    if args.parts:
        from benchmarks import gpu_quick
        known = gpu_quick.part_names(args)
        bad = [n for n in args.parts.split(",")
               if n and not gpu_quick.select([(k,) for k in known], n)]
        if bad:
            p.error(f"--parts: unknown part(s) {bad}; accepted: {sorted(set(known))}")
    args.steps = args.steps if args.steps is not None else 1 if args.tiny else 10 if args.quick else 20
    args.warmup = args.warmup if args.warmup is not None else 0 if args.tiny else 2 if args.quick else 3
    if args.pipeline_cores is None:
        n = len(pipeline_lib.usable_cores())
        counts = [c for c in (1, 2, 4, 8, 16, 32, 64) if c < n] + [n]
        args.pipeline_cores = ",".join(map(str, counts[:1] if args.tiny else counts))
    if args.norm is None:
        args.norm = TINY_NORMS if args.tiny else "all"
    elif args.norm != "all":  # before the runs: train_step refused it only in the log of each
        bad = [n for n in args.norm.split(",") if n.strip() not in NORM_NAMES]
        if bad or not args.norm.strip(","):
            p.error(f"--norm: unknown {bad}; accepted: 'all' or a comma list of {NORM_NAMES}")
    if args.tiny:  # an explicit --norm is kept (it was replaced by layernorm,rmsnorm silently)
        args.models, args.batch, args.dtype = "Ti/4", 4, "float32"
        args.num_classes = 10
    elif args.doc is None and not args.quick:
        args.doc = os.path.join("docs", "benchmarks.md")
    if not args.dry_run:  # before the runs (minutes to an hour), not a traceback after them
        try:
            tool_flags.check_output("out", args.out, folder=True)
            if args.doc:
                tool_flags.check_output("doc", args.doc)
                check_markers(args.doc)
        except ValueError as e:
            p.error(str(e))
    # after every check: a refused command leaves no temporary folder behind
    args.temp_cache = args.compile_cache is None and args.quick and not args.dry_run
    if args.compile_cache is None:
        args.compile_cache = tempfile.mkdtemp(prefix="gpu_table_jax_cache_") if args.temp_cache else ""
    return args


def _slug(model: str) -> str:
    return model.replace("/", "")


def commands(args: argparse.Namespace) -> list[tuple[str, list[str], str, float]]:
    """(name, command, json path, timeout) for every run, in order."""
    py = [sys.executable, "-m"]
    tiny = ["--depth=1", "--image_size=8"] if args.tiny else []
    common = [f"--batch={args.batch}", f"--dtype={args.dtype}", f"--steps={args.steps}",
              f"--warmup={args.warmup}", f"--num_classes={args.num_classes}", *tiny]
    out = []
    models = [m for m in args.models.split(",") if m]
    n_norms = N_NORMS if args.norm == "all" else len(args.norm.split(",")) + 1
    for m in models:
        j = os.path.join(args.out, f"train_{_slug(m)}.json")
        cmd = py + ["benchmarks.train_step", f"--model={m}", f"--norm={args.norm}", "--isolate",
                    f"--norm_timeout={args.norm_timeout}",
                    f"--isolate_dir={os.path.join(args.out, 'train_' + _slug(m))}", *common,
                    f"--json={j}"]
        out.append((f"train_{_slug(m)}", cmd, j, args.norm_timeout * n_norms + 120))
    # each norm layer alone (forward+backward at the smallest model's activation): a norm's own
    # cost, which the train step's matmuls hide
    j = os.path.join(args.out, "norm_kernels.json")
    kern = (["--model=Ti/4", "--batch=2", "--steps=1", "--warmup=0"] if args.tiny else
            [f"--model={models[-1]}", f"--batch={args.batch}", f"--steps={args.steps}",
             f"--warmup={args.warmup}"])
    named = REGISTRY_ONLY if args.norm == "all" else [n for n in args.norm.split(",")
                                                      if n in REGISTRY_ONLY]
    out.append(("norm_kernels", py + ["benchmarks.norm_kernels",
                                      f"--norm={','.join([KERNEL_NORMS, *named])}",
                                      f"--dtype={args.dtype}", *kern, f"--json={j}"],
                j, args.norm_timeout))
    aug_model = models[-1]  # the smallest (fastest) model: augmentation's largest share
    j = os.path.join(args.out, "augment.json")
    out.append(("augment", py + ["benchmarks.train_step", f"--model={aug_model}", "--norm=layernorm",
                                 "--augment=none,randaugment,deit", *common, f"--json={j}"],
                j, args.norm_timeout * 3 + 120))
    torch_ok = importlib.util.find_spec("torch") and importlib.util.find_spec("timm")
    if not args.no_torch and (torch_ok or args.dry_run):
        for m in models:
            j = os.path.join(args.out, f"vs_torch_{_slug(m)}.json")
            out.append((f"vs_torch_{_slug(m)}",
                        py + ["benchmarks.vs_torch", f"--model={m}", *common, f"--json={j}"],
                        j, args.torch_timeout))
    if args.pipeline_cores:
        j = os.path.join(args.out, "input_pipeline.json")
        size = ["--batch=8", "--batches=1", "--synthetic_examples=16"] if args.tiny else \
            ["--batch=256", "--batches=10", "--synthetic_examples=1024"]
        out.append(("input_pipeline", py + ["benchmarks.input_pipeline",
                                            f"--cores={args.pipeline_cores}", *size,
                                            f"--json={j}"], j, args.pipeline_timeout))
        # the pipeline feeding the S/16 step as the loop runs them: the share of time the step waits
        j = os.path.join(args.out, "input_feed.json")
        feed = (["--batch=8", "--batches=1", "--steps=1", "--synthetic_examples=16",
                 "--model=Ti/4", "--image_size=8", "--depth=1"] if args.tiny else
                [f"--batch={args.batch}", "--batches=10", "--steps=30",
                 f"--synthetic_examples={4 * args.batch}"])
        out.append(("input_feed", py + ["benchmarks.input_pipeline", "--datasets=imagenet2012",
                                        *feed, f"--json={j}"], j, args.pipeline_timeout))
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.quick:
        from benchmarks import gpu_quick
        try:
            res = gpu_quick.run(args)
        finally:
            if args.temp_cache:
                shutil.rmtree(args.compile_cache, ignore_errors=True)
        if args.doc and not args.dry_run:
            write_between_markers(args.doc, res["markdown"])
        return res
    cmds = commands(args)
    if args.dry_run:
        for _, cmd, _, timeout in cmds:
            print(f"timeout {timeout:.0f} " + shlex.join(cmd))
        print("# then, one run each: --xla_flags=" + " | --xla_flags=".join(GPU_FLAGS_TO_TRY))
        return {"commands": [c for _, c, _, _ in cmds], "results": {}}
    os.makedirs(args.out, exist_ok=True)
    env = dict(os.environ)
    if args.xla_flags:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + args.xla_flags).strip()
    results, failures = {}, []
    for name, cmd, j, timeout in cmds:
        o = isolate.run_one(name, cmd, j, os.path.join(args.out, f"{name}.log"), timeout, env=env)
        print(f"[gpu_table] {name}: {o.status} in {o.seconds:.0f} s" +
              (f" ({o.reason})" if o.reason else ""), file=sys.stderr, flush=True)
        if o.status == "ok":
            results[name] = o.result
        else:
            failures.append(f"{name}: {o.status}: {o.reason} (log {o.log})")
    if args.no_torch or not any(n.startswith("vs_torch") for n, *_ in cmds):
        failures.append("vs_torch: not run (" + ("--no_torch" if args.no_torch else
                                                 "torch/timm not installed") + ")")
    md = render(results, failures, args)
    files.write_text_atomic(os.path.join(args.out, "gpu_table.md"), md + "\n")
    if args.doc:
        write_between_markers(args.doc, md)
    print(md)
    return {"commands": [c for _, c, _, _ in cmds], "results": results, "failures": failures,
            "markdown": md}


def render(results: dict[str, Any], failures: list[str], args: argparse.Namespace) -> str:
    """The markdown: machine and versions, then the per-norm and the timm tables."""
    first = next(iter(results.values()), {})
    m = first.get("machine", {})
    versions = ", ".join(f"{k} {m[k]}" for k in ("python", "jax", "jaxlib", "flax", "optax", "torch",
                                               "timm") if k in m)
    torch_res = next((r for n, r in results.items() if n.startswith("vs_torch")), {})
    for k in ("torch", "timm"):
        tm = torch_res.get("machine", {})
        if k in tm and k not in m:
            versions += f", {k} {tm[k]}"
    lines = [f"Measured {m.get('date', '?')} on {m.get('devices', '?')} (host {m.get('host', '?')}, "
             f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores); {versions}; {m.get('xla', '')}.",
             f"Batch {args.batch}, {args.dtype}, {args.num_classes} classes, {args.steps} timed steps "
             f"after {args.warmup}; each norm in its own process (ratio to LayerNorm: ratio of "
             f"medians); MFU: analytic model FLOPs / step time / "
             f"{_f(first.get('peak_flops', float('nan')) / 1e12, 4)} TFLOP/s "
             f"({first.get('peak_source', '-')}).", "",
             "| model | norm | step_s | img/s | TFLOP/step | MFU | peak GiB | ratio to LN | "
             "FLOP ratio | within | compile_s |", "|" + "---|" * 11]
    for name, res in results.items():
        if not name.startswith("train_"):
            continue
        model = res["args"]["model"]
        for r in res["rows"]:
            # the device's own peak; where it reports none (CPU), XLA's estimate, marked as such
            mem = (_f(r["device_peak_gib"]) if r.get("device_peak_gib") is not None
                   else f"{_f(r['xla_peak_gib'])} (XLA est.)" if r.get("xla_peak_gib") is not None
                   else "-")  # neither figure (XLA's memory analysis failed): no estimate to mark
            lines.append(" | ".join(["", model, r["norm"], r["step_s"], _f(r["images_per_s"], 4),
                                     _f(r["model_gflops"] / 1e3, 4), _f(r["mfu"]), mem,
                                     r.get("time_ratio", "-"), _f(r.get("flop_ratio")),
                                     r.get("within", "-"), _f(r["compile_s"])]).strip() + " |")
        for fl in res.get("failures", []):
            failures.append(f"{model} {fl['norm']}: {fl['status']}: {fl['reason']}")
    torch_rows = [(n, r) for n, r in results.items() if n.startswith("vs_torch")]
    if torch_rows:
        lines += ["", "| model | impl | step_s | img/s | this project's speed vs it (per round) |",
                  "|---|---|---|---|---|"]
        for _, res in torch_rows:
            speeds = res.get("speeds", {"timm": res.get("speed_vs_timm")})
            for r in res["rows"]:
                s = speeds.get(r["impl"])
                rel = "-" if r["impl"] == "jax" or s is None else \
                    f"{s['median']:.3f} [{s['lo']:.3f}, {s['hi']:.3f}]"
                lines.append(f"| {res['args']['model']} | {r['impl']} | {r['step_s']} | "
                             f"{_f(r['images_per_s'], 4)} | {rel} |")
            if res.get("torch_peak_gib") is not None:
                lines.append(f"| {res['args']['model']} | peak GiB | jax {_f(res.get('jax_device_peak_gib'))}"
                             f" | torch {_f(res['torch_peak_gib'])} | |")
    kern = results.get("norm_kernels")
    if kern:
        b, t, c = kern["shape"]
        lines += ["", f"Each norm layer alone, activation ({b}, {t}, {c}) {kern['args']['dtype']} "
                  "(`benchmarks.norm_kernels`; train: forward + backward + statistics, eval: "
                  "forward):", "", "| mode | norm | ms | ratio to LN |", "|---|---|---|---|"]
        lines += [f"| {r['mode']} | {r['norm']} | {r['ms']} | {r['ratio_to_ln']} |"
                  for r in kern["rows"]]
    aug = results.get("augment")
    if aug:
        lines += ["", f"On-device augmentation in the train step ({aug['args']['model']}, LayerNorm; "
                  "DeiT's RandAugment rand-m9-mstd0.5-inc1, then + Mixup/CutMix and erasing):", "",
                  "| step | step_s | img/s | time ratio |", "|---|---|---|---|"]
        for r in aug["rows"]:
            lines.append(f"| {r['norm']} | {r['step_s']} | {_f(r['images_per_s'], 4)} | "
                         f"{r.get('time_ratio', '-')} |")
    pipe = results.get("input_pipeline")
    if pipe:
        fastest = max((r["images_per_s"] for n, res in results.items() if n.startswith("train_")
                       for r in res["rows"] if r["norm"] == "layernorm"), default=None)
        lines += ["", "Host input pipeline (ImageNet-size synthetic JPEGs: decode, random resized "
                  "crop, flip; `data.antialias=False`), pinned to N cores"
                  + (f"; headroom against the fastest LayerNorm step ({_f(fastest, 4)} img/s)"
                     if fastest else "") + ":", "",
                  "| cores | img/s | img/s per core | efficiency | headroom |", "|---|---|---|---|---|"]
        for r in pipe["rows"]:
            head = _f(r["images_s"] / fastest) if fastest else "-"
            lines.append(f"| {r['cores']} | {_f(r['images_s'], 4)} | {_f(r['images_s_per_core'], 4)}"
                         f" | {r['efficiency']} | {head} |")
    feed = results.get("input_feed")
    if feed:
        r = feed["rows"][0]
        lines += ["", f"Pipeline feeding the {r['model']} step as the loop runs them (batch "
                  f"{r['batch']}, {r['workers']} decode workers): pipeline alone "
                  f"{_f(r['pipeline_ex_s'], 4)} img/s, step alone {_f(r['step_ex_s'], 4)} img/s, "
                  f"time the step waited for data {_f(r['wait_fraction'])} of the run."]
    if failures:
        lines += ["", "Not measured: " + "; ".join(failures) + "."]
    lines += ["", f"Command: `python -m benchmarks.gpu_table --out={args.out}`"
              + (f" (XLA_FLAGS += `{args.xla_flags}`)" if args.xla_flags else "")]
    return "\n".join(lines)


def check_markers(path: str) -> str:
    """``path``'s text, which must hold BEGIN ... END in this order (ValueError otherwise)."""
    try:
        with open(path) as f:
            doc = f.read()
    except OSError as e:
        raise ValueError(f"--doc={path}: cannot be read ({type(e).__name__}: {e.strerror or e})"
                         ) from None
    if BEGIN not in doc or END not in doc or doc.index(BEGIN) > doc.index(END):
        raise ValueError(f"--doc={path}: needs the markers {BEGIN} ... {END} (in this order)")
    return doc


def write_between_markers(path: str, text: str) -> None:
    """Replaces what lies between BEGIN and END in ``path`` (both markers must be there)."""
    head, rest = check_markers(path).split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    files.write_text_atomic(path, f"{head}{BEGIN}\n{text}\n{END}{tail}")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    with cli.tool_errors("python -m benchmarks.gpu_table"):  # Ctrl-C: one line and 130
        args = parse(argv)
        return run(args)


if __name__ == "__main__":
    main()
