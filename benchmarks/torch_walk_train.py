"""The walk "a model trained in PyTorch, here" (docs/pretrained.md, "Measured with trained weights"):
train a small timm ViT (LayerNorm, or SLAB's RepBN in every norm slot) on an IDX dataset
(Fashion-MNIST's layout) in PyTorch; write DIR/<norm>.safetensors, the test images as uint8
(N, 28, 28, 3) (DIR/test_u8.npy, DIR/test_y.npy) and PyTorch's eval logits (DIR/<norm>_logits.npy).
Needs torch and timm (the ``.[torch]`` extra; without them: one line, exit 2; not run in CI):

    python -m benchmarks.torch_walk_train --src=IDX_DIR --norm=ln --out=DIR --epochs=60
    python -m benchmarks.torch_walk_train --src=IDX_DIR --norm=repbn --out=DIR --epochs=60

then import, export and compare as docs/pretrained.md shows (benchmarks/torch_walk_compare.py).
"""
from __future__ import annotations

import gzip
import os
import sys
import time
from typing import Any, Sequence

import numpy as np

from normvit_jax import cli, tool_flags

BATCH, SIZE = 64, 28


def idx(path: str) -> np.ndarray:
    """An IDX array (gzip): magic, dims, then uint8 data."""
    with gzip.open(path) as f:
        b = f.read()
    nd = b[3]
    dims = [int.from_bytes(b[4 + 4 * i: 8 + 4 * i], "big") for i in range(nd)]
    return np.frombuffer(b, np.uint8, offset=4 + 4 * nd).reshape(dims)


def load(src: str, split: str) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 images (N, 28, 28, 3): grayscale copied to RGB, as data.prepare does; int64 labels)."""
    x = idx(os.path.join(src, f"{split}-images-idx3-ubyte.gz"))
    y = idx(os.path.join(src, f"{split}-labels-idx1-ubyte.gz")).astype(np.int64)
    return np.repeat(x[..., None], 3, -1), y


def build(norm: str) -> Any:
    """timm's ViT at 28 px, patch 4, width 64, depth 4, 4 heads, class token; LayerNorm (eps 1e-6,
    timm's) or SLAB's RepBN (classification/models/prepbn.py: BN over tokens + alpha * x)."""
    import torch
    from torch import nn
    from timm.models.vision_transformer import VisionTransformer

    class RepBN(nn.Module):  # SLAB's: y = BatchNorm1d(x over tokens) + alpha * x
        def __init__(self, channels: int, **_: Any) -> None:  # timm passes device=, dtype=
            super().__init__()
            self.alpha = nn.Parameter(torch.ones(1))
            self.bn = nn.BatchNorm1d(channels)

        def forward(self, x: Any) -> Any:
            x = x.transpose(1, 2)
            return (self.bn(x) + self.alpha * x).transpose(1, 2)

    kw = dict(img_size=SIZE, patch_size=4, in_chans=3, num_classes=10, embed_dim=64, depth=4,
              num_heads=4, mlp_ratio=2.0, global_pool="token")
    return VisionTransformer(**kw, norm_layer=RepBN) if norm == "repbn" else VisionTransformer(**kw)


def train(src: str, norm: str, out: str, epochs: int) -> None:
    import torch
    from torch import nn
    from safetensors.torch import save_file
    from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

    torch.manual_seed(0)
    np.random.seed(0)
    torch.set_num_threads(2)
    xtr, ytr = load(src, "train")
    xte, yte = load(src, "t10k")
    mean = torch.tensor(IMAGENET_DEFAULT_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_DEFAULT_STD).view(1, 3, 1, 1)

    def prep(u8: np.ndarray) -> Any:  # data.normalize=imagenet: (x/255 - mean)/std, NCHW
        return (torch.from_numpy(u8).permute(0, 3, 1, 2).float() / 255 - mean) / std

    model = build(norm)
    print(model.blocks[0].norm1, model.norm)
    steps = epochs * (len(xtr) // BATCH)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-3, total_steps=steps, pct_start=0.1)
    lossf = nn.CrossEntropyLoss(label_smoothing=0.1)
    t0, step = time.time(), 0
    for ep in range(epochs):
        model.train()
        perm = np.random.permutation(len(xtr))
        for i in range(len(xtr) // BATCH):
            j = perm[i * BATCH:(i + 1) * BATCH]
            xb = xtr[j].copy()
            flip = np.random.rand(BATCH) < 0.5
            xb[flip] = xb[flip, :, ::-1]
            pad = np.pad(xb, ((0, 0), (2, 2), (2, 2), (0, 0)))  # shifts of up to 2 px
            dy, dx = np.random.randint(0, 5, 2)
            xb = pad[:, dy:dy + SIZE, dx:dx + SIZE]
            loss = lossf(model(prep(np.ascontiguousarray(xb))), torch.from_numpy(ytr[j]))
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            step += 1
        print(f"epoch {ep + 1}/{epochs} step {step} loss {loss.item():.4f} {time.time() - t0:.0f}s",
              flush=True)
    model.eval()
    with torch.no_grad():
        logits = torch.cat([model(prep(xte[i:i + 256])) for i in range(0, len(xte), 256)]).numpy()
    print(f"{norm}: torch eval top-1 {(logits.argmax(1) == yte).mean():.4f} on {len(yte)} test "
          f"images, train {time.time() - t0:.0f}s")
    os.makedirs(out, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              os.path.join(out, f"{norm}.safetensors"))
    np.save(os.path.join(out, f"{norm}_logits.npy"), logits)
    np.save(os.path.join(out, "test_u8.npy"), xte)
    np.save(os.path.join(out, "test_y.npy"), yte)


def main(argv: Sequence[str] | None = None) -> int:
    """Bad input: one line and exit 2, Ctrl-C one line and 130 (docs/faults.md)."""
    with cli.tool_errors("python -m benchmarks.torch_walk_train"):
        return _main(argv)


def _main(argv: Sequence[str] | None) -> int:
    ap = tool_flags.Parser("python -m benchmarks.torch_walk_train", __doc__)
    ap.add_argument("--src", required=True, help="folder with the train-/t10k- IDX files (gzip)")
    ap.add_argument("--norm", choices=["ln", "repbn"], required=True,
                    help="ln: timm's LayerNorm ViT; repbn: SLAB's RepBN in every norm slot")
    ap.add_argument("--out", required=True, help="folder for the weights, logits and test images")
    ap.add_argument("--epochs", type=int, default=60, help="passes over the train split")
    a = ap.parse_args(argv)
    err = None
    if not os.path.isfile(os.path.join(a.src, "train-images-idx3-ubyte.gz")):
        err = f"--src={a.src}: no train-images-idx3-ubyte.gz there (an IDX dataset's folder)"
    else:
        try:
            import timm  # noqa: F401
            import torch  # noqa: F401
        except ImportError as e:
            err = f"needs torch and timm ({e}): pip install -e '.[torch]'"
    if err:
        print(f"{ap.prog}: error: {err}", file=sys.stderr)
        return 2
    train(a.src, a.norm, a.out, a.epochs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
