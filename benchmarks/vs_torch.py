"""The same ViT trained for a step in timm/PyTorch and in this project, alternating, in one run.

    python -m benchmarks.vs_torch --model=Ti/4 --batch=128 --steps=7

Same depth, width, heads, MLP width, patch, image size, classes, batch and dtype; both with a
class token, learned position embedding, pre-norm LayerNorm (eps 1e-6), tanh GELU (``--gelu``),
AdamW (weight decay 0.05) with global-norm clipping at 1.0; cross-entropy loss. timm runs eager
with its defaults (fused ``scaled_dot_product_attention``). Steps alternate (which side goes
first alternates too) and the report gives the median per-pair ratio timm_time / jax_time:
above 1 this project is faster.

Needs the optional extra: ``pip install torch==2.13.0 timm`` (``pip install -e '.[torch]'``).
"""
from __future__ import annotations

from benchmarks import xla_flags

xla_flags.apply()

import argparse  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any, Sequence  # noqa: E402

import numpy as np  # noqa: E402

from benchmarks import common  # noqa: E402
from normvit_jax import models  # noqa: E402

INSTALL_HINT = ("benchmarks.vs_torch needs PyTorch and timm: pip install torch==2.13.0 timm "
                "(or pip install -e '.[torch]')")


def import_torch_timm() -> tuple[Any, Any]:
    """torch and timm, or SystemExit with the install line. A CPU torch next to the CUDA-only
    torchvision build in the registry fails timm's import ('operator torchvision::nms does not
    exist'); declaring the missing operator names lets timm's model code load."""
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
    p = argparse.ArgumentParser(prog="python -m benchmarks.vs_torch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="Ti/4")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--steps", type=int, default=7, help="timed pairs")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--image_size", type=int, default=None)
    p.add_argument("--depth", type=int, default=None)
    p.add_argument("--num_classes", type=int, default=10)
    p.add_argument("--gelu", default="tanh", choices=["tanh", "exact"],
                   help="both sides; timm's default is exact, Google's checkpoints use tanh")
    p.add_argument("--attention_impl", default=None, choices=common.ATTENTION_IMPLS)
    p.add_argument("--torch_threads", type=int, default=None, help="default: torch's own")
    p.add_argument("--xla_preset", default=xla_flags.DEFAULT_PRESET, choices=list(xla_flags.PRESETS))
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def torch_step(torch: Any, timm: Any, spec: Any, args: argparse.Namespace, size: int):
    """timm's VisionTransformer with this project's hyperparameters and a full AdamW step."""
    from timm.models.vision_transformer import VisionTransformer
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    act = (lambda: torch.nn.GELU(approximate="tanh")) if args.gelu == "tanh" else torch.nn.GELU
    model = VisionTransformer(
        img_size=size, patch_size=spec.patch_size, embed_dim=spec.hidden_size,
        depth=spec.depth, num_heads=spec.num_heads, mlp_ratio=spec.mlp_dim / spec.hidden_size,
        num_classes=args.num_classes, qkv_bias=True, class_token=True, global_pool="token",
        act_layer=act)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), weight_decay=0.05)
    g = torch.Generator().manual_seed(0)
    x = torch.rand((args.batch, 3, size, size), generator=g) * 2 - 1
    y = torch.randint(0, args.num_classes, (args.batch,), generator=g)
    autocast = args.dtype == "bfloat16"

    def step() -> float:
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.float(), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        float(loss.detach())  # synchronise (CPU eager is synchronous already; keeps the contract)
        return time.perf_counter() - t

    n_params = sum(p.numel() for p in model.parameters())
    return step, n_params


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch, timm = import_torch_timm()
    overrides = {"gelu_approximate": args.gelu == "tanh"}
    if args.attention_impl:
        overrides["attention_impl"] = args.attention_impl
    cfg = common.bench_config(args.model, "layernorm", image_size=args.image_size, batch=args.batch,
                              dtype=args.dtype, num_classes=args.num_classes, depth=args.depth,
                              model_overrides=overrides)
    size = int(cfg.data.image_size)
    jb = common.compile_train("jax", cfg, num_classes=args.num_classes)
    n_jax = sum(int(np.prod(x.shape)) for x in __import__("jax").tree.leaves(jb.state.params))
    tstep, n_torch = torch_step(torch, timm, models.spec_of(cfg.model), args, size)
    if n_jax != n_torch:
        print(f"warning: parameter counts differ: jax {n_jax:,} vs timm {n_torch:,}", file=sys.stderr)
    times = common.interleaved({"jax": jb.step, "timm": tstep}, args.steps, args.warmup)
    speed = common.summarize([t / j for t, j in zip(times["timm"], times["jax"])])
    rows = [{"impl": name, "step_s": common.summarize(ts).fmt(),
             "images_per_s": round(args.batch / common.summarize(ts).median, 1),
             "params": n_jax if name == "jax" else n_torch} for name, ts in times.items()]
    return {"machine": {**common.machine(), "torch_threads": torch.get_num_threads()},
            "args": vars(args), "rows": rows, "times": times, "speed_vs_timm": speed,
            "jax_compile_s": jb.compile_s, "jax_flops": jb.flops}


def report(res: dict[str, Any]) -> str:
    a = res["args"]
    s = res["speed_vs_timm"]
    head = (f"vs timm: model={a['model']} batch={a['batch']} dtype={a['dtype']} gelu={a['gelu']}; "
            f"{a['steps']} timed pairs after {a['warmup']}; step time median [p25, p75] s")
    verdict = (f"speed of this project relative to timm eager (timm time / jax time, per pair): "
               f"median {s.median:.3f} [p25 {s.lo:.3f}, p75 {s.hi:.3f}]")
    return "\n".join([head, common.table(res["rows"], ["impl", "step_s", "images_per_s", "params"]),
                      verdict])


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    return common.run_entry(parse, run, report, argv)


if __name__ == "__main__":
    main()
