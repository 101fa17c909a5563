"""Inference latency of exported artifacts where users deploy them (issue 34): per norm, unfolded
and folded (``--fold``), in ONNX Runtime (CPU), TF SavedModel (CPU) and JAX (the StableHLO
artifact under ``jax.jit``), at batch 1 and 32, for ViT-S/16 at 224 px and the demo model; with
timm's ViT-S/16 in PyTorch (eager, ``torch.compile``) and exported to ONNX Runtime as anchors.

    python -m benchmarks.deploy [--models=S/16,demo] [--norms=layernorm,...] [--batches=1,32]
                                [--reps=10] [--reps_large=3] [--threads=2] [--md=docs/benchmarks.md]

Weights are random, drawn as timm draws its ViT's (``model.param_init='timm'``: normal(0.02),
DeiT's), so that ours and the timm anchor have attention logits of the same size: latency does
depend on them. ONNX Runtime's softmax on an AVX-512 Intel CPU took 0.08 ms on a (1, 6, 197, 197)
row block of N(0, 1) logits and 0.96 ms at N(0, 30^2) (2026-11-27), and with Google's init
(xavier) the folded RepBN ViT-S/16 ran 1.11x timm's time against 0.98x with timm's init, the
softmax 5.6 against 1.1 ms a call (docs/benchmarks.md). The norms' statistics are moved off their
initial values so folding is not a special case. The unfolded and folded artifacts of
a norm are timed alternately, call by call, so a shared machine's drift hits both alike; medians
of ``--reps`` calls (``--reps_large`` at batch >= 16) after two warm-up calls. Sessions called in
turn must not busy-wait: an ONNX Runtime session's idle threads spin for the next call by
default, and on 2 cores two alternating sessions then slow each other by up to 1.5x (measured
2026-11-26: folded RepBN and timm's ViT-S/16, alternating, 102 vs 121 ms with spinning, 74 vs 70
ms without; alone 69-83 ms each). So every ONNX Runtime session here has spinning off, and
PyTorch's OpenMP threads wait passively (``OMP_WAIT_POLICY=PASSIVE``). ``--md``: the
table replaces the block between the ``deploy-table`` markers of that file.

On a GPU (JAX's backend is one): the StableHLO artifact runs there ("JAX jit GPU"; inputs from
and outputs to host memory, as a service), timm's anchors run in PyTorch on the same GPU, the
folded RepBN artifact is timed against timm's ``torch.compile`` on it, and ``--md`` fills the
``deploy-table-gpu`` block instead (the CPU table stays). The GPU hosts have neither TensorFlow
nor ONNX Runtime (and onnxruntime-gpu's wheel is over what a lease carries), so there:

    python -m benchmarks.deploy --runtimes=stablehlo --models=S/16 --md=docs/benchmarks.md
"""
from __future__ import annotations

from benchmarks import xla_flags

xla_flags.apply()

import argparse  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import Any, Callable, Sequence  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import common, files  # noqa: E402
from normvit_jax import models, tool_flags  # noqa: E402
from normvit_jax.deploy import artifact, bundle, errors, runtimes  # noqa: E402

NORMS = ("layernorm", "batchnorm", "unified", "repbn", "progressive", "zscore_repbn", "dyt",
         "derf", "dtn")
LABELS = {"layernorm": "LN", "batchnorm": "BN", "unified": "UN", "repbn": "RepBN",
          "progressive": "progressive LN->RepBN", "zscore_repbn": "z-score->RepBN", "dyt": "DyT",
          "derf": "Derf", "dtn": "DTN"}
RUNTIMES = {"onnx": "ONNX Runtime CPU", "savedmodel": "TF SavedModel CPU", "stablehlo": "JAX jit CPU"}
GPU_RUNTIMES = {**RUNTIMES, "stablehlo": "JAX jit GPU"}  # the StableHLO artifact runs where JAX does
EXT = {"onnx": ".onnx", "savedmodel": "", "stablehlo": ".stablehlo"}
BEGIN, END = "<!-- deploy-table:begin -->", "<!-- deploy-table:end -->"
GPU_BEGIN, GPU_END = "<!-- deploy-table-gpu:begin -->", "<!-- deploy-table-gpu:end -->"
OURS_ANCHOR = "RepBN folded, this project's ONNX Runtime CPU"
RATIO = "RepBN folded / timm, ONNX Runtime, per interleaved round"
OURS_GPU_ANCHOR = "RepBN folded, this project's StableHLO in JAX on the GPU"
GPU_RATIO = "RepBN folded (JAX GPU) / timm torch.compile GPU, per interleaved round"


def on_gpu() -> bool:
    """Whether JAX (so the StableHLO artifact) runs on a GPU here; then torch's anchors run on it
    too, and the table goes between the deploy-table-gpu markers (the CPU table stays)."""
    return jax.default_backend() == "gpu"


def runtime_labels() -> dict[str, str]:
    return GPU_RUNTIMES if on_gpu() else RUNTIMES


def _importable(name: str) -> bool:
    import importlib.util
    try:
        return importlib.util.find_spec(name) is not None
    except ValueError:  # sys.modules[name] is None: blocked
        return False


def config(model: str, norm: str) -> Any:
    """ViT-S/16 at 224 px (1000 classes) or the demo model (configs/vit_ln.py:demo, 8x8 digits),
    with ``norm`` in every slot (benchmarks.common.NORMS)."""
    if model == "demo":
        from configs import vit_ln
        c = vit_ln.get_config("demo")
        for k, v in common.NORMS[norm].items():
            c.model[k] = v
        return c
    c = common.bench_config(model, norm, image_size=224, num_classes=1000)
    c.model.param_init = "timm"  # the anchor's weight distribution (module docstring)
    return c


def variables_of(c: Any, num_classes: int, seed: int = 0) -> dict:
    spec = models.spec_of(c.model, num_classes)
    size = int(c.data.image_size)
    v = jax.jit(lambda k: models.create(spec).init(k, np.zeros((1, size, size, 3), np.float32),
                                                   train=False))(jax.random.key(seed))
    rng = np.random.default_rng(seed)

    def perturb(path: Any, a: Any) -> np.ndarray:  # running statistics off (0, 1)
        a, key = np.asarray(a), jax.tree_util.keystr(path)
        if "batch_stats" not in key or not np.issubdtype(a.dtype, np.floating):
            return a
        if "var" in key:
            return (a * rng.uniform(0.5, 1.5, a.shape)).astype(a.dtype)
        return (a + 0.1 * rng.standard_normal(a.shape)).astype(a.dtype)
    return jax.tree_util.tree_map_with_path(perturb, v)


def time_alternating(fns: dict[str, Callable], x: np.ndarray | None, reps: int
                     ) -> dict[str, np.ndarray]:
    """Seconds per call of each function (of ``x``, or of nothing when ``x`` is None), ``reps``
    rounds of one call each, interleaved, the order rotated every round; round r of every
    function is element r (so per-round ratios pair calls made moments apart)."""
    names = list(fns)
    call = (lambda n: fns[n]()) if x is None else (lambda n: fns[n](x))  # noqa: E731
    for name in names:
        for _ in range(2):
            call(name)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(reps):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t = time.perf_counter()
            call(name)
            times[name].append(time.perf_counter() - t)
    return {n: np.asarray(ts) for n, ts in times.items()}


def _row(times: np.ndarray, batch: int, **fields: Any) -> dict:
    """Median latency and images/s of one function's calls, with the quartiles (the spread)."""
    s = float(np.median(times))
    return {**fields, "batch": batch, "median_ms": s * 1e3, "images_per_s": batch / s,
            "p25_ms": float(np.percentile(times, 25)) * 1e3,
            "p75_ms": float(np.percentile(times, 75)) * 1e3, "reps": len(times)}


def bench_norm(model: str, norm: str, args: Any, tmp: str) -> list[dict]:
    c = config(model, norm)
    n = 1000 if model != "demo" else 10
    v = variables_of(c, n)
    bundles = {"unfolded": bundle.from_variables(c, c.model, v, n, log=None)}
    folded = bundle.from_variables(c, c.model, v, n, fold=True, log=None)
    if folded.source.get("folded"):
        bundles["folded"] = folded
    rows = []
    for fmt in args.runtimes:
        runs, export_s = {}, {}
        for kind, b in bundles.items():
            path = os.path.join(tmp, f"{model.replace('/', '')}_{norm}_{kind}{EXT[fmt]}")
            t = time.perf_counter()
            try:
                artifact.export_artifact(b, fmt, path, log=None)
            except errors.UnsupportedOpError as e:  # Derf as a SavedModel (docs/deploy.md)
                print(f"{model} {norm} {kind} {fmt}: skipped: {e}", flush=True)
                continue
            export_s[kind] = time.perf_counter() - t
            runs[kind] = runtimes.open_artifact(path, fmt, threads=args.threads, spin=False)
        for batch in args.batches if runs else ():
            size = int(c.data.image_size)
            x = np.random.default_rng(batch).integers(0, 256, (batch, size, size, 3), np.uint8)
            reps = args.reps_large if batch >= 16 else args.reps
            med = time_alternating(runs, x, reps)
            for kind, ts in med.items():
                rows.append(_row(ts, batch, model=model, norm=norm, kind=kind, runtime=fmt,
                                 export_s=export_s[kind],
                                 folded_slots=len(bundles[kind].source.get("folded", []))))
            print(json.dumps(rows[-1]) if len(med) == 1 else json.dumps(rows[-2:]), flush=True)
        del runs
        gc.collect()
    return rows


def _torch_timm() -> tuple[Any, Any]:
    """(torch, timm), or (None, why not): imported first, since torchvision's import crashes
    once TensorFlow is loaded (benchmarks.vs_torch.import_torch_timm)."""
    try:
        from benchmarks.vs_torch import import_torch_timm
        return import_torch_timm()
    except SystemExit as e:
        return None, str(e)


def timm_anchors(args: Any, tmp: str) -> list[dict]:
    """timm's ViT-S/16 (1000 classes, float32): PyTorch eager, torch.compile, ONNX Runtime."""
    torch, timm = args.torch_timm
    if torch is None:
        print(f"timm anchors skipped: {timm}", flush=True)
        return []
    gpu = on_gpu() and torch.cuda.is_available()
    device, where = ("cuda", "GPU") if gpu else ("cpu", "")
    torch.set_num_threads(args.threads)
    net = timm.create_model("vit_small_patch16_224", pretrained=False, num_classes=1000).eval()
    rows = []
    fns: dict[str, Callable] = {}

    def torch_fn(m: Any) -> Callable:
        def run(x: np.ndarray) -> Any:  # from host memory to host memory, as a service does
            with torch.inference_mode():
                return m(torch.from_numpy(x).to(device)).cpu().numpy()
        return run
    c = config("S/16", "repbn")
    b = bundle.from_variables(c, c.model, variables_of(c, 1000), 1000, fold=True, log=None)
    ours: dict[str, Callable] = {}
    if _importable("onnxruntime"):  # the acceptance's pair: folded RepBN and timm in ORT (CPU)
        import onnxruntime as ort
        path = os.path.join(tmp, "timm_vit_s16.onnx")
        try:  # exported while the model is still on the CPU
            torch.onnx.export(net, (torch.zeros(1, 3, 224, 224),), path, input_names=["x"],
                              output_names=["logits"], dynamic_axes={"x": {0: "n"}},
                              dynamo=False)
            opts = ort.SessionOptions()
            opts.intra_op_num_threads = args.threads
            opts.add_session_config_entry("session.intra_op.allow_spinning", "0")  # as ours
            session = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
            fns["timm ONNX Runtime CPU"] = lambda x: session.run(None, {"x": x})
        except Exception as e:  # noqa: BLE001
            print(f"timm ONNX export skipped: {type(e).__name__}: {str(e)[:200]}", flush=True)
        onnx_path = os.path.join(tmp, "repbn_folded_anchor.onnx")
        artifact.export_artifact(b, "onnx", onnx_path, log=None)
        ours[OURS_ANCHOR] = runtimes.open_artifact(onnx_path, "onnx", threads=args.threads,
                                                   spin=False)
    else:
        print("ONNX Runtime anchors skipped: onnxruntime is not installed here", flush=True)
    if args.anchors == "yes":  # --anchors=onnx: only the ONNX Runtime pair (a shorter run)
        net = net.to(device)
        fns[f"timm PyTorch eager {where}".strip()] = torch_fn(net)
        try:
            fns[f"timm PyTorch torch.compile {where}".strip()] = torch_fn(torch.compile(net))
        except Exception as e:  # noqa: BLE001  an inductor without a C++ compiler
            print(f"torch.compile skipped: {type(e).__name__}: {e}", flush=True)
    if gpu:  # on a GPU: the folded RepBN artifact in JAX against timm on the same GPU
        hlo_path = os.path.join(tmp, "repbn_folded_anchor.stablehlo")
        artifact.export_artifact(b, "stablehlo", hlo_path, log=None)
        ours[OURS_GPU_ANCHOR] = runtimes.open_artifact(hlo_path, "stablehlo")
    pairs = [(OURS_ANCHOR, "timm ONNX Runtime CPU", RATIO),
             (OURS_GPU_ANCHOR, "timm PyTorch torch.compile GPU", GPU_RATIO)]
    for batch in args.batches:
        x = np.random.default_rng(batch).standard_normal((batch, 3, 224, 224), np.float32)
        pixels = np.random.default_rng(batch).integers(0, 256, (batch, 224, 224, 3), np.uint8)
        reps = args.reps_large if batch >= 16 else (args.anchor_reps or args.reps)
        calls = {name: (lambda fn=fn: fn(x)) for name, fn in fns.items()}
        calls.update({name: (lambda fn=fn: fn(pixels)) for name, fn in ours.items()})
        for name, fn in list(calls.items()):
            try:
                fn()
            except Exception as e:  # noqa: BLE001  torch.compile fails at its first call
                print(f"{name} skipped: {type(e).__name__}: {str(e)[:200]}", flush=True)
                del calls[name]
        times = time_alternating(calls, None, reps)
        for name, ts in times.items():
            rows.append(_row(ts, batch, model="S/16", norm="timm LN", kind=name, runtime=name))
            print(json.dumps(rows[-1]), flush=True)
        for a, timm_name, label in pairs:
            if a not in times or timm_name not in times:
                continue
            ratio = times[a] / times[timm_name]  # calls made moments apart: the drift is shared
            rows.append({"model": "S/16", "norm": "timm LN", "kind": "ratio", "batch": batch,
                         "runtime": label, "median": float(np.median(ratio)),
                         "p25": float(np.percentile(ratio, 25)),
                         "p75": float(np.percentile(ratio, 75)), "reps": len(ratio)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def _cell(r: dict | None, spread: bool = False) -> str:
    if r is None:
        return "-"
    if "median" in r:  # a ratio
        return f"{r['median']:.3f} (IQR {r['p25']:.3f}-{r['p75']:.3f}, {r['reps']} rounds)"
    text = f"{r['median_ms']:.1f} ms ({r['images_per_s']:.3g}/s)"
    if spread and "p25_ms" in r:
        text += f", IQR {r['p25_ms']:.0f}-{r['p75_ms']:.0f} ms"
    return text


def _ordered(names: set, canonical: Any) -> list:
    """``names`` in the order of ``canonical`` (rows of several runs joined: one order)."""
    order = list(canonical)
    return sorted(names, key=lambda n: (order.index(n) if n in order else len(order), n))


def table(rows: list[dict], header: str) -> str:
    """Markdown: per model, norm and runtime, median ms (images/s) unfolded, folded, and the
    folded/unfolded time ratio per batch."""
    out = [header, ""]
    labels = runtime_labels()
    batches = sorted({r["batch"] for r in rows})
    for model in dict.fromkeys(r["model"] for r in rows):
        out += [f"**{'ViT-S/16, 224 px, 1000 classes' if model != 'demo' else 'demo model (8x8 digits, 4 blocks of 64)'}**", ""]
        cols = " | ".join(f"batch {b}: unfolded | folded | folded/unfolded" for b in batches)
        out += [f"| norm | runtime | {cols} |", "|---|---|" + "---|" * (3 * len(batches))]
        ours = [r for r in rows if r["model"] == model and not r["norm"].startswith("timm")]
        for norm in _ordered({r["norm"] for r in ours}, NORMS):
            folds = any(r["kind"] == "folded" for r in ours if r["norm"] == norm)
            for fmt in _ordered({r["runtime"] for r in ours}, labels):
                cells = []
                for b in batches:
                    got = {r["kind"]: r for r in ours if (r["norm"], r["runtime"], r["batch"]) == (norm, fmt, b)}
                    u, f = got.get("unfolded"), got.get("folded")
                    ratio = (f"{f['median_ms'] / u['median_ms']:.2f}" if u and f else
                             "nothing folds" if u and not folds else "-")
                    cells += [_cell(u), _cell(f), ratio]
                if any(c != "-" for c in cells):
                    out.append(f"| {LABELS.get(norm, norm)} | {labels[fmt]} | " + " | ".join(cells) + " |")
        anchors = [r for r in rows if r["model"] == model and r["norm"].startswith("timm")]
        if anchors:
            out += ["", "| anchors, timed interleaved (timm ViT-S/16 with LayerNorm; this project's "
                "folded RepBN ViT-S/16) | " + " | ".join(f"batch {b}" for b in batches) + " |",
                    "|---|" + "---|" * len(batches)]
            for name in dict.fromkeys(r["runtime"] for r in anchors):
                cells = []
                for b in batches:
                    r = next((r for r in anchors if (r["runtime"], r["batch"]) == (name, b)), None)
                    cells.append(_cell(r, spread=True))
                out.append(f"| {name} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def check_args(p: tool_flags.Parser, args: Any) -> None:
    """The list flags as lists, each value known, the outputs writable and the --include files
    read: before the exports and timings, a bad value is one line and exit 2 (was a KeyError or
    ValueError traceback, or one after the whole run)."""
    args.runtimes = [r.strip() for r in args.runtimes.split(",") if r.strip()]
    bad = [r for r in args.runtimes if r not in RUNTIMES]
    if bad or not args.runtimes:
        p.error(f"--runtimes: unknown {bad}; accepted: a comma list of {list(RUNTIMES)}")
    bad = [n for n in args.norms.split(",") if n not in common.NORMS]
    if bad:
        p.error(f"--norms: unknown {bad}; accepted: a comma list of {list(common.NORMS)}")
    try:
        args.batches = [tool_flags.positive_int(b) for b in args.batches.split(",")]
    except (ValueError, argparse.ArgumentTypeError):
        p.error(f"--batches={args.batches}: accepted: a comma list of integers >= 1")
    for m in args.models.split(","):
        if m != "demo":
            common.default_image_size(m)  # ValueError (exit 2) for a name that is no preset
    for flag in ("json", "md"):
        if getattr(args, flag):
            tool_flags.check_output(flag, getattr(args, flag))
    args.earlier_rows = []
    for path in filter(None, args.include.split(",")):
        try:
            with open(path) as f:
                args.earlier_rows += json.load(f)
        except (OSError, ValueError) as e:
            p.error(f"--include={path}: cannot be read as an earlier --json ({type(e).__name__}: "
                    f"{e})")


def write_md(path: str, text: str) -> None:
    doc = ""
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            doc = f.read()
    begin, end = (GPU_BEGIN, GPU_END) if on_gpu() else (BEGIN, END)
    block = f"{begin}\n{text}\n{end}"
    if begin in doc and end in doc:
        doc = doc[:doc.index(begin)] + block + doc[doc.index(end) + len(end):]
    else:
        doc = doc.rstrip("\n") + "\n\n" + block + "\n"
    files.write_text_atomic(path, doc)  # a Ctrl-C mid-write must not truncate the doc


def provenance() -> str:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip()
    except OSError:
        commit = "?"
    versions = [f"jax {jax.__version__}"]
    for name in ("onnxruntime", "tensorflow", "torch"):
        if sys.modules.get(name) is not None:  # what this run used, not what it could import
            versions.append(f"{name} {sys.modules[name].__version__}")
    gpu = f" and {jax.devices()[0].device_kind}" if on_gpu() else ""
    return (f"Measured {datetime.date.today().isoformat()} at commit {commit} on "
            f"{platform.processor() or platform.machine()} with {os.cpu_count()} cores{gpu}, "
            f"{', '.join(versions)}; float32, median latency per call (images/s), inputs from "
            "and outputs to host memory; ONNX Runtime sessions without spinning threads (the "
            "module docstring says why).")


PROG = "python -m benchmarks.deploy"


def main(argv: Sequence[str] | None = None) -> list[dict]:
    with common.tool_errors(PROG):  # bad input: one line, exit 2
        return _main(argv)


def _main(argv: Sequence[str] | None) -> list[dict]:
    p = tool_flags.Parser(PROG, __doc__)
    p.add_argument("--models", default="S/16,demo",
                   help="comma list of models: ViT presets '<size>/<patch>' or demo (the digits "
                        "demo's)")
    p.add_argument("--norms", default=",".join(NORMS),
                   help="comma list of normalizers (benchmarks/common.py NORMS)")
    p.add_argument("--runtimes", default="onnx,savedmodel,stablehlo",
                   help="comma list of artifact formats to export and time: onnx, savedmodel, "
                        "stablehlo")
    p.add_argument("--batches", default="1,32", help="comma list of batch sizes to time")
    p.add_argument("--reps", type=tool_flags.positive_int, default=10,
                   help="timed calls at small batches")
    p.add_argument("--reps_large", type=tool_flags.positive_int, default=3,
                   help="timed calls at batch >= 16")
    p.add_argument("--threads", type=tool_flags.positive_int, default=2,
                   help="intra-op threads of every runtime")
    p.add_argument("--anchors", default="yes", choices=["yes", "onnx", "no"],
                   help="timm's ViT-S/16 in PyTorch (eager, compile) and ONNX Runtime; onnx: "
                   "only timm in ONNX Runtime against the folded RepBN ViT-S/16")
    p.add_argument("--anchor_reps", type=tool_flags.positive_int, default=None,
                   help="interleaved rounds of the anchors (default: --reps)")
    p.add_argument("--md", default=None, help="markdown file whose deploy-table block to replace")
    p.add_argument("--json", default=None, help="also write the results as JSON to this file")
    p.add_argument("--include", default="",
                   help="comma-separated --json files of earlier runs whose rows join the table "
                   "(a long measurement in parts)")
    p.add_argument("--xla_preset", default=xla_flags.DEFAULT_PRESET, choices=list(xla_flags.PRESETS),
                   help="XLA:CPU flags set before JAX starts: tuned (this project's measured "
                        "settings) or default (XLA's own); benchmarks/xla_flags.py")
    args = p.parse_args(argv)
    check_args(p, args)
    rows: list[dict] = []
    args.torch_timm = (None, "--anchors=no")
    if args.anchors != "no" and "S/16" in args.models.split(","):
        # PyTorch's OpenMP threads sleep between calls too (read when torch loads it)
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        args.torch_timm = _torch_timm()  # before TensorFlow (the SavedModel runtime) is imported
    with tempfile.TemporaryDirectory(prefix="deploy-bench-") as tmp:
        for model in args.models.split(","):
            for norm in args.norms.split(","):
                rows += bench_norm(model, norm, args, tmp)
                common.write_json(args.json, rows)  # atomic: Ctrl-C keeps the last whole file
        if args.anchors != "no" and "S/16" in args.models.split(","):
            rows += timm_anchors(args, tmp)
    common.write_json(args.json, rows)
    text = table(args.earlier_rows + rows, provenance())
    print(text)
    if args.md:
        write_md(args.md, text)
    return rows


if __name__ == "__main__":
    main()
