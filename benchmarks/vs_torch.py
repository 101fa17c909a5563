"""The same ViT trained for a step in timm/PyTorch and in this project, alternating, in one run.

    python -m benchmarks.vs_torch --model=Ti/4 --batch=128 --steps=7

Same depth, width, heads, MLP width, patch, image size, classes, batch and dtype; both with a
class token, learned position embedding, pre-norm LayerNorm (eps 1e-6), tanh GELU (``--gelu``),
AdamW (weight decay 0.05) with global-norm clipping at 1.0; cross-entropy loss. timm runs with
its defaults (fused ``scaled_dot_product_attention``). Where torch sees a GPU (``torch_plan``) it
runs on that GPU like JAX does, eager and ``torch.compile``d, with bfloat16 autocast for
``--dtype=bfloat16``, TF32 float32 matmuls (XLA's GPU default too) and fused AdamW; JAX then
allocates GPU memory on demand so both fit. On CPU timm runs eager, as before. Steps alternate
(the order rotates) and the report gives the median per-round ratio timm_time / jax_time for
each timm variant: above 1 this project is faster. ``--model=B/16,S/16`` measures several models
one after another in one process (one torch/JAX start; ``--json`` rewritten after each model).

Needs the optional extra: ``pip install -e '.[torch]'`` (torch 2.14.1 + torchvision 0.29.1 + timm).
"""
from __future__ import annotations

from benchmarks import xla_flags

xla_flags.apply()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any, Sequence  # noqa: E402

import numpy as np  # noqa: E402

from benchmarks import common  # noqa: E402
from normvit_jax import tool_flags  # noqa: E402
from normvit_jax import models  # noqa: E402

INSTALL_HINT = ("benchmarks.vs_torch needs PyTorch and timm: pip install -e '.[torch]' "
                "(torch==2.14.1 torchvision==0.29.1 timm)")


def import_torch_timm() -> tuple[Any, Any]:
    """torch and timm, or SystemExit with the install line (or, when TensorFlow is already
    loaded, with why this must be a process of its own). A CPU torch next to the CUDA-only
    torchvision build in the registry fails timm's import ('operator torchvision::nms does not
    exist'); declaring the missing operator names lets timm's model code load."""
    if "tensorflow" in sys.modules:  # torchvision's import segfaults after TensorFlow 2.21's
        raise SystemExit("benchmarks.vs_torch: TensorFlow is already imported in this process and "
                         "torchvision (timm) crashes when imported after it; run python -m "
                         "benchmarks.vs_torch in its own process")
    try:
        import torch
    except ImportError:
        raise SystemExit(INSTALL_HINT) from None
    try:
        import timm
    except ImportError:
        raise SystemExit(INSTALL_HINT) from None
    except RuntimeError as e:
        if "torchvision::" not in str(e):
            raise
        for m in [m for m in sys.modules if m.split(".")[0] in ("timm", "torchvision")]:
            del sys.modules[m]
        lib = torch.library.Library("torchvision", "DEF")
        for op in ("nms", "qnms"):
            lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        import_torch_timm.lib = lib  # keep the registration alive
        import timm
    return torch, timm


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = tool_flags.Parser("python -m benchmarks.vs_torch", __doc__)
    p.add_argument("--model", default="Ti/4",
                   help="a preset, or a comma list measured one after another in this process")
    p.add_argument("--batch", type=tool_flags.positive_int, default=128, help="global batch")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="compute dtype (parameters stay float32)")
    p.add_argument("--steps", type=tool_flags.positive_int, default=7, help="timed pairs")
    p.add_argument("--warmup", type=tool_flags.non_negative_int, default=2,
                   help="untimed rounds before the timed ones")
    p.add_argument("--image_size", type=tool_flags.positive_int, default=None,
                   help="input resolution (default: 32 for a patch of at most 8, else 224)")
    p.add_argument("--depth", type=tool_flags.positive_int, default=None,
                   help="transformer blocks (default: the model preset's)")
    p.add_argument("--num_classes", type=tool_flags.positive_int, default=10, help="classes of the head")
    p.add_argument("--gelu", default="tanh", choices=["tanh", "exact"],
                   help="both sides; timm's default is exact, Google's checkpoints use tanh")
    p.add_argument("--attention_impl", default=None, choices=common.ATTENTION_IMPLS,
                   help="model.attention_impl (default: the config's, auto)")
    p.add_argument("--torch_threads", type=tool_flags.positive_int, default=None, help="default: torch's own")
    p.add_argument("--torch_device", default="auto", choices=["auto", "cuda", "cpu"],
                   help="auto: cuda when torch sees a GPU")
    p.add_argument("--torch_compile", default="auto", choices=["auto", "yes", "no"],
                   help="also time a torch.compile'd timm; auto: on cuda only")
    p.add_argument("--xla_preset", default=xla_flags.DEFAULT_PRESET, choices=list(xla_flags.PRESETS),
                   help="XLA:CPU flags set before JAX starts: tuned (this project's measured "
                        "settings) or default (XLA's own); benchmarks/xla_flags.py")
    p.add_argument("--time_budget_s", type=float, default=None,
                   help="with several models: start no model once this many seconds have passed")
    p.add_argument("--json", default=None, help="also write the results as JSON to this file")
    return p.parse_args(argv)


@dataclasses.dataclass(frozen=True)
class TorchPlan:
    """How the timm side runs: where, which variants, which numerics."""

    device: str                # 'cuda' or 'cpu'
    variants: tuple[str, ...]  # 'eager' and/or 'compiled' (torch.compile)
    autocast: str | None       # 'bfloat16' or None
    fused_adamw: bool          # one fused CUDA kernel for the AdamW update
    tf32: bool                 # float32 matmuls in TF32, as XLA's GPU default precision does
    jax_preallocate: bool      # False: JAX allocates on demand, sharing the GPU with torch


def torch_plan(cuda_available: bool, dtype: str, device: str = "auto",
               compile_: str = "auto") -> TorchPlan:
    """The timm side for this host: the GPU (eager and compiled) when torch sees one, else the
    CPU (eager, the behaviour measured in docs/benchmarks.md)."""
    if device == "cuda" and not cuda_available:
        raise SystemExit("--torch_device=cuda: torch sees no CUDA device")
    on_gpu = device == "cuda" or (device == "auto" and cuda_available)
    compiled = compile_ == "yes" or (compile_ == "auto" and on_gpu)
    return TorchPlan(device="cuda" if on_gpu else "cpu",
                     variants=("eager", "compiled") if compiled else ("eager",),
                     autocast="bfloat16" if dtype == "bfloat16" else None,
                     fused_adamw=on_gpu, tf32=on_gpu, jax_preallocate=not on_gpu)


def share_gpu_with_torch(plan: TorchPlan) -> bool:
    """JAX takes 75% of GPU memory when its backend starts unless told otherwise: on a plan that
    puts torch on the GPU, ask for on-demand allocation. False if JAX had started already."""
    if plan.jax_preallocate:
        return True
    if xla_flags.backend_started():
        return False
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    return True


def torch_steps(torch: Any, timm: Any, spec: Any, args: argparse.Namespace, size: int,
                plan: TorchPlan, peaks: dict[str, int] | None = None) -> tuple[dict[str, Any], int]:
    """{'timm' (eager), 'timm_compiled'}: timm's VisionTransformer with this project's
    hyperparameters and a full AdamW step each (separate models, the same initialisation).
    On CUDA, ``peaks[name]`` becomes each variant's own peak bytes over its steps: the allocator's
    peak during the step less what the other variants hold at rest (parameters, gradients,
    optimizer state), i.e. what that variant would peak at alone (the batch included)."""
    resident: dict[str, Any] = {}

    def nbytes(ts: Any) -> int:
        return sum(t.numel() * t.element_size() for t in ts if torch.is_tensor(t))
    from timm.models.vision_transformer import VisionTransformer
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    if plan.tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    dev = torch.device(plan.device)
    act = (lambda: torch.nn.GELU(approximate="tanh")) if args.gelu == "tanh" else torch.nn.GELU
    g = torch.Generator().manual_seed(0)
    x = (torch.rand((args.batch, 3, size, size), generator=g) * 2 - 1).to(dev)
    y = torch.randint(0, args.num_classes, (args.batch,), generator=g).to(dev)
    sync = torch.cuda.synchronize if plan.device == "cuda" else (lambda: None)

    def make(variant: str) -> tuple[Any, int]:
        torch.manual_seed(0)
        model = VisionTransformer(
            img_size=size, patch_size=spec.patch_size, embed_dim=spec.hidden_size,
            depth=spec.depth, num_heads=spec.num_heads, mlp_ratio=spec.mlp_dim / spec.hidden_size,
            num_classes=args.num_classes, qkv_bias=True, class_token=True, global_pool="token",
            act_layer=act).to(dev)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), weight_decay=0.05,
                                **({"fused": True} if plan.fused_adamw else {}))
        forward = torch.compile(model) if variant == "compiled" else model
        name = "timm" if variant == "eager" else "timm_compiled"
        params = list(model.parameters())
        resident[name] = lambda: nbytes(params) + nbytes(p.grad for p in params) + nbytes(
            t for st in opt.state.values() for t in st.values())

        def step() -> float:
            on_cuda = plan.device == "cuda" and peaks is not None
            if on_cuda:
                others = sum(f() for n, f in resident.items() if n != name)
                torch.cuda.reset_peak_memory_stats()
            t = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            with torch.autocast(plan.device, dtype=torch.bfloat16, enabled=plan.autocast is not None):
                logits = forward(x)
            loss = torch.nn.functional.cross_entropy(logits.float(), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sync()
            float(loss.detach())
            dt = time.perf_counter() - t
            if on_cuda:
                peaks[name] = max(peaks.get(name, 0), torch.cuda.max_memory_allocated() - others)
            return dt

        return step, sum(p.numel() for p in model.parameters())

    steps, n_params = {}, 0
    for variant in plan.variants:
        steps["timm" if variant == "eager" else "timm_compiled"], n_params = make(variant)
    return steps, n_params


def run(args: argparse.Namespace) -> dict[str, Any]:
    """One model: its result. Several (``--model=B/16,S/16``): one after another in this process
    (torch and JAX start once), each freed before the next, ``{'models': [result, ...]}``,
    rewritten to ``--json`` after each model."""
    torch, timm = import_torch_timm()
    plan = torch_plan(bool(torch.cuda.is_available()), args.dtype, args.torch_device, args.torch_compile)
    if not share_gpu_with_torch(plan):
        print("warning: JAX started before vs_torch could turn its GPU preallocation off; torch "
              "may run out of memory", file=sys.stderr)
    names = [m for m in args.model.split(",") if m]
    if len(names) == 1:
        res = run_model(args, names[0], torch, timm, plan, jax_top=0)
        res.pop("_jax_top")
        return res
    t0, out, top = time.monotonic(), {"args": vars(args), "models": [], "skipped": []}, 0
    for m in names:
        if args.time_budget_s and time.monotonic() - t0 > args.time_budget_s:
            out["skipped"].append(m)
            continue
        res = run_model(args, m, torch, timm, plan, jax_top=top)
        top = max(top, res.pop("_jax_top"))
        out["models"].append(res)
        out["machine"] = res["machine"]
        common.write_json(args.json, out)
        _free(torch, plan)
    return out


def _free(torch: Any, plan: TorchPlan) -> None:
    import gc

    import jax
    gc.collect()
    jax.clear_caches()
    torch._dynamo.reset()
    if plan.device == "cuda":
        torch.cuda.empty_cache()


def run_model(args: argparse.Namespace, model: str, torch: Any, timm: Any, plan: TorchPlan,
              jax_top: int) -> dict[str, Any]:
    """The JAX step and the timm variants of one model, alternating. JAX's device peak only grows
    within a process: it is this model's when it exceeds ``jax_top`` (the earlier models'),
    else None (``jax_device_peak_le_gib``: at most that)."""
    import jax
    args = argparse.Namespace(**{**vars(args), "model": model})
    overrides = {"gelu_approximate": args.gelu == "tanh"}
    if args.attention_impl:
        overrides["attention_impl"] = args.attention_impl
    cfg = common.bench_config(args.model, "layernorm", image_size=args.image_size, batch=args.batch,
                              dtype=args.dtype, num_classes=args.num_classes, depth=args.depth,
                              model_overrides=overrides)
    size = int(cfg.data.image_size)
    jb = common.compile_train("jax", cfg, num_classes=args.num_classes)
    # progress on stderr (compiles and torch.compile take minutes at B/16), as train_step's
    print(f"{model}: compiled jax in {jb.compile_s:.1f} s", file=sys.stderr, flush=True)
    n_jax = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(jb.state.params))
    peaks: dict[str, int] = {}
    t = time.perf_counter()
    tsteps, n_torch = torch_steps(torch, timm, models.spec_of(cfg.model), args, size, plan, peaks)
    print(f"{model}: timm {', '.join(plan.variants)} on {plan.device} ready in "
          f"{time.perf_counter() - t:.1f} s; timing {args.warmup} + {args.steps} rounds",
          file=sys.stderr, flush=True)
    if n_jax != n_torch:
        print(f"warning: parameter counts differ: jax {n_jax:,} vs timm {n_torch:,}", file=sys.stderr)
    times = common.interleaved({"jax": jb.step, **tsteps}, args.steps, args.warmup)
    speeds = {name: common.summarize([t / j for t, j in zip(times[name], times["jax"])])
              for name in tsteps}
    rows = [{"impl": name, "step_s": common.summarize(ts).fmt(),
             "step_median_s": common.summarize(ts).median,
             "images_per_s": round(args.batch / common.summarize(ts).median, 1),
             "params": n_jax if name == "jax" else n_torch,
             "peak_gib": common.gib(peaks.get(name))} for name, ts in times.items()]
    jax_peak = common.device_peak_bytes() or 0
    return {"machine": {**common.machine(), "torch_threads": torch.get_num_threads(),
                        "torch_device": plan.device},
            "args": vars(args), "plan": dataclasses.asdict(plan), "rows": rows, "times": times,
            "speed_vs_timm": speeds["timm"], "speeds": speeds, "jax_compile_s": jb.compile_s,
            "jax_flops": jb.flops,
            "jax_device_peak_gib": common.gib(jax_peak) if jax_peak > jax_top else None,
            "jax_device_peak_le_gib": common.gib(jax_top) if 0 < jax_peak <= jax_top else None,
            "torch_peak_gib": common.gib(max(peaks.values())) if peaks else None,
            "_jax_top": jax_peak}


def report(res: dict[str, Any]) -> str:
    if "models" in res:
        skipped = [f"NOT MEASURED {m}: --time_budget_s spent" for m in res["skipped"]]
        return "\n\n".join([report(r) for r in res["models"]] + skipped)
    a = res["args"]
    p = res.get("plan", {})
    head = (f"vs timm: model={a['model']}{common.depth_label(a)} "
            f"image={a['image_size'] or 'default'} batch={a['batch']} dtype={a['dtype']} "
            f"gelu={a['gelu']}; "
            f"timm on {p.get('device', 'cpu')} ({', '.join(p.get('variants', ['eager']))}, autocast "
            f"{p.get('autocast')}, fused AdamW {p.get('fused_adamw', False)}); {a['steps']} timed "
            f"rounds after {a['warmup']}; step time median [p25, p75] s")
    cols = ["impl", "step_s", "images_per_s", "params"]
    out = [head, common.table(res["rows"], cols + (["peak_gib"] if res.get("torch_peak_gib") else []))]
    for name, s in res.get("speeds", {"timm": res["speed_vs_timm"]}).items():
        what = "timm eager" if name == "timm" else "timm torch.compile"
        out.append(f"speed of this project relative to {what} ({name} time / jax time, per round): "
                   f"median {s.median:.3f} [p25 {s.lo:.3f}, p75 {s.hi:.3f}]")
    if res.get("torch_peak_gib") is not None:
        jax_peak = res.get("jax_device_peak_gib")
        jax_peak = (f"{jax_peak:.2f}" if jax_peak is not None else
                    f"<= {res.get('jax_device_peak_le_gib') or float('nan'):.2f}")
        out.append(f"peak memory: jax {jax_peak} GiB (the process's device peak), each timm variant "
                   "its own (the allocator's peak during its steps less the other variant's "
                   "parameters, gradients and optimizer state)")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    return common.run_entry(parse, run, report, argv)


if __name__ == "__main__":
    main()
