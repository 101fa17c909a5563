"""The walk "a model trained in PyTorch, here" (docs/pretrained.md, "Measured with trained weights"):
train a small timm ViT (LayerNorm, or SLAB's RepBN in every norm slot) on an IDX dataset
(Fashion-MNIST's layout) in PyTorch; write DIR/<norm>.safetensors, the test images as uint8
(N, 28, 28, 3) (DIR/test_u8.npy, DIR/test_y.npy) and PyTorch's eval logits (DIR/<norm>_logits.npy).
Needs torch and timm (not a dependency of this project; not run in CI):

    python -m benchmarks.torch_walk_train --src=IDX_DIR --norm=ln --out=DIR --epochs=60
    python -m benchmarks.torch_walk_train --src=IDX_DIR --norm=repbn --out=DIR --epochs=60

then import, export and compare as docs/pretrained.md shows (benchmarks/torch_walk_compare.py).
"""
import argparse, gzip, time, numpy as np, torch, torch.nn as nn, timm
from functools import partial
from safetensors.torch import save_file
from timm.models.vision_transformer import VisionTransformer
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

ap = argparse.ArgumentParser()
ap.add_argument('--src', required=True, help='folder with train-/t10k- IDX files (gzip)')
ap.add_argument('--norm', choices=['ln', 'repbn'], required=True)
ap.add_argument('--out', required=True)
ap.add_argument('--epochs', type=int, default=60)
a = ap.parse_args(); src, norm, out, epochs = a.src, a.norm, a.out, a.epochs
torch.manual_seed(0); np.random.seed(0); torch.set_num_threads(2)

def idx(path):
    b = gzip.open(path).read()
    nd = b[3]; dims = [int.from_bytes(b[4 + 4*i: 8 + 4*i], 'big') for i in range(nd)]
    return np.frombuffer(b, np.uint8, offset=4 + 4*nd).reshape(dims)

xtr = np.repeat(idx(f'{src}/train-images-idx3-ubyte.gz')[..., None], 3, -1)  # grayscale -> RGB, as prepare
ytr = idx(f'{src}/train-labels-idx1-ubyte.gz').astype(np.int64)
xte = np.repeat(idx(f'{src}/t10k-images-idx3-ubyte.gz')[..., None], 3, -1)
yte = idx(f'{src}/t10k-labels-idx1-ubyte.gz').astype(np.int64)
mean = torch.tensor(IMAGENET_DEFAULT_MEAN).view(1, 3, 1, 1); std = torch.tensor(IMAGENET_DEFAULT_STD).view(1, 3, 1, 1)

def prep(u8):  # data.normalize=imagenet: (x/255 - mean)/std, NCHW
    return (torch.from_numpy(u8).permute(0, 3, 1, 2).float() / 255 - mean) / std

class RepBN(nn.Module):  # SLAB classification/models/prepbn.py, verbatim
    def __init__(self, channels, **dd):  # timm passes device=, dtype=
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1))
        self.bn = nn.BatchNorm1d(channels)
    def forward(self, x):
        x = x.transpose(1, 2)
        x = self.bn(x) + self.alpha * x
        return x.transpose(1, 2)

kw = dict(img_size=28, patch_size=4, in_chans=3, num_classes=10, embed_dim=64, depth=4, num_heads=4,
          mlp_ratio=2.0, global_pool='token')
model = VisionTransformer(**kw, norm_layer=RepBN) if norm == 'repbn' else VisionTransformer(**kw)
print(model.blocks[0].norm1, model.norm)
bs = 64; steps = epochs * (len(xtr) // bs)
opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.05)
sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-3, total_steps=steps, pct_start=0.1)
lossf = nn.CrossEntropyLoss(label_smoothing=0.1)
t0 = time.time(); step = 0
for ep in range(epochs):
    model.train(); perm = np.random.permutation(len(xtr))
    for i in range(len(xtr) // bs):
        j = perm[i*bs:(i+1)*bs]; xb = xtr[j].copy()
        flip = np.random.rand(bs) < 0.5; xb[flip] = xb[flip, :, ::-1]
        pad = np.pad(xb, ((0, 0), (2, 2), (2, 2), (0, 0)))  # shifts of up to 2 px
        dy, dx = np.random.randint(0, 5, 2); xb = pad[:, dy:dy+28, dx:dx+28]
        loss = lossf(model(prep(np.ascontiguousarray(xb))), torch.from_numpy(ytr[j]))
        opt.zero_grad(); loss.backward(); opt.step(); sched.step(); step += 1
    print(f'epoch {ep+1}/{epochs} step {step} loss {loss.item():.4f} {time.time()-t0:.0f}s', flush=True)
model.eval()
with torch.no_grad():
    logits = torch.cat([model(prep(xte[i:i+256])) for i in range(0, len(xte), 256)]).numpy()
print(f'{norm}: torch eval top-1 {(logits.argmax(1) == yte).mean():.4f} on {len(yte)} test images, train {time.time()-t0:.0f}s')
save_file({k: v.contiguous() for k, v in model.state_dict().items()}, f'{out}/{norm}.safetensors')
np.save(f'{out}/{norm}_logits.npy', logits); np.save(f'{out}/test_u8.npy', xte); np.save(f'{out}/test_y.npy', yte)
