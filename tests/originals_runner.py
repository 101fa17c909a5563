"""Builds a tiny model from a method's ORIGINAL PyTorch code, gives every parameter and buffer
random values, and writes its state dict (.safetensors), the input images and its eval logits.

    python tests/originals_runner.py METHOD ORIGINALS_DIR OUT_DIR

ORIGINALS_DIR holds the original repositories checked out under their GitHub names (DIR/SLAB,
DIR/DyT, ...), the layout and commits of ``python -m benchmarks.originals --src=DIR`` (docs/norms.md).
Run in its own process (the originals import top-level packages named ``models``); needs torch and
timm. tests/test_pretrained_originals.py calls it and loads the file into this project's model.
"""
from __future__ import annotations

import importlib.util
import os
import sys

import numpy as np
import torch
from safetensors.torch import save_file

DIM, HEADS, NCLS = 16, 2, 5


def _import(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _randomize(model: torch.nn.Module, seed: int, linear_norm_iter: int = 0) -> None:
    """Random values for every tensor; variances positive; SLAB's step buffers set explicitly."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if not t.is_floating_point():
                if name.endswith(("iter", "total_step", "warm")):
                    t.fill_({"iter": linear_norm_iter, "total_step": 1000, "warm": 0}[
                        name.rsplit(".", 1)[-1]])
                continue
            r = torch.randn(t.shape, generator=g) * (0.1 if t.ndim >= 2 else 0.3)
            if name.endswith(("running_var", "running_phi")):
                r = 0.5 + torch.rand(t.shape, generator=g)
            elif name.endswith(("weight", ".a", "alpha")) and t.ndim <= 1 and "pos_proj" not in name:
                r = 1 + r  # norm scales near 1 (a Linear's 2-D weight stays small)
            t.copy_(r)


def build(method: str, root: str) -> tuple[torch.nn.Module, int]:
    """(the original model, its image size)."""
    if method in ("slab_repbn", "slab_progressive"):
        sys.path.insert(0, os.path.join(root, "SLAB", "classification"))
        from models import deit  # noqa: E402  pylint: disable=import-outside-toplevel
        norm = deit.RepBN if method == "slab_repbn" else deit.linearnorm
        model = deit.VisionTransformer(img_size=32, patch_size=8, embed_dim=DIM, depth=2,
                                       num_heads=HEADS, num_classes=NCLS, norm_layer=norm)
        return model, 32
    if method in ("dyt", "derf", "dyt_avg", "derf_avg"):
        from timm.models.vision_transformer import VisionTransformer  # pylint: disable=import-outside-toplevel
        # _avg: their ImageNet scripts' global_pool='avg' (class token kept, fc_norm)
        pool = {"global_pool": "avg"} if method.endswith("_avg") else {}
        model = VisionTransformer(img_size=32, patch_size=8, embed_dim=DIM, depth=2, num_heads=HEADS,
                                  num_classes=NCLS, **pool)
        if method.startswith("dyt"):
            conv = _import(os.path.join(root, "DyT", "dynamic_tanh.py"), "dyt_original")
            return conv.convert_ln_to_dyt(model), 32
        conv = _import(os.path.join(root, "Derf", "ViT", "dynamic_erf.py"),
                       "derf_original")
        return conv.convert_ln_to_derf(model), 32
    if method == "learnable_scaler":
        # the fork's own timm (0.8.21dev0) with LearnableScaler as every norm layer
        sys.path.insert(0, os.path.join(root, "LearnableScaler"))
        from timm.layers.norm import LearnableScaler  # pylint: disable=import-outside-toplevel
        from timm.models.vision_transformer import VisionTransformer  # pylint: disable=import-outside-toplevel
        return VisionTransformer(img_size=32, patch_size=8, embed_dim=DIM, depth=2, num_heads=HEADS,
                                 num_classes=NCLS, norm_layer=LearnableScaler), 32
    if method in ("dtn", "dtn_powernorm"):
        sys.path.insert(0, os.path.join(root, "DTN"))
        from models import vit_norm_mix  # noqa: E402  pylint: disable=import-outside-toplevel
        # the grid must be DTN's 14 x 14 (its resolution default); DTN in blocks 0-1, LN after.
        # PowerNorm ('power': groups = heads, warm-up 3000) runs in eval only (its training
        # forward calls an undefined function)
        model = vit_norm_mix.VisionTransformer(img_size=56, patch_size=4, embed_dim=DIM, depth=3,
                                               num_heads=HEADS, num_classes=NCLS,
                                               norm_type="dtn" if method == "dtn" else "power",
                                               local_up_to_layer=2)
        return model, 56
    raise SystemExit(f"unknown method {method!r}")


def main(method: str, root: str, out: str) -> None:
    model, image = build(method, root)
    _randomize(model, seed=7, linear_norm_iter=250)
    model.eval()
    images = torch.randn(3, 3, image, image, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = model(images)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              os.path.join(out, "model.safetensors"))
    np.save(os.path.join(out, "images.npy"), images.numpy().transpose(0, 2, 3, 1))  # NHWC
    np.save(os.path.join(out, "logits.npy"), logits.numpy())


if __name__ == "__main__":
    main(*sys.argv[1:4])
