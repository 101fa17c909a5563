"""The cases of ``benchmarks.originals``: each normalizer next to its original PyTorch module.

Imports torch: ``benchmarks.originals`` imports this file only once torch has imported. Each
case loads one file of an original repository by path (``load``), gives the original and this
project's norm the same random parameters, and runs both in train mode for some steps (forward,
gradients of sum(w * y) for one random cotangent w, the state after each step), then in eval
mode. The originals run in float64; this project's norms compute in float32 as they always do
(docs/norms.md, Common rules), on the same float32-representable inputs, so a few 1e-7..1e-5
of relative error is float32's and a wrong rule shows as 1e-2 or more.
"""
from __future__ import annotations

import ast
import contextlib
import copy
import functools
import importlib.util
import os
import sys
import types
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import torch

from normvit_jax import norms
from normvit_jax.norms.gradient_rule import train_grads

torch.set_default_dtype(torch.float64)


class Skip(Exception):
    """A case that cannot run here (its repository or file is missing): a skipped row."""


def load(src: str, repo: str, path: str, names: dict[str, Any] | None = None) -> types.ModuleType:
    """One original file imported by path; ``names`` are set in its namespace before it runs
    (a stub for a name the file lacks)."""
    full = os.path.join(src, repo, path)
    if not os.path.isfile(full):
        raise Skip(f"{os.path.join(repo, path)} not found under --src")
    spec = importlib.util.spec_from_file_location(f"_orig_{repo}_{os.path.basename(path)[:-3]}", full)
    mod = importlib.util.module_from_spec(spec)
    mod.__dict__.update(names or {})
    spec.loader.exec_module(mod)
    return mod


def load_class(src: str, repo: str, path: str, cls: str) -> type:
    """One class of a file whose other imports belong to a framework (a vendored timm): only that
    class's source is run, with torch and nn in its namespace."""
    full = os.path.join(src, repo, path)
    if not os.path.isfile(full):
        raise Skip(f"{os.path.join(repo, path)} not found under --src")
    tree = ast.parse(open(full).read())
    node = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls), None)
    if node is None:
        raise Skip(f"class {cls} not in {os.path.join(repo, path)}")
    ns = {"torch": torch, "nn": torch.nn}
    exec(compile(ast.Module([node], []), full, "exec"), ns)
    return ns[cls]


class Errors:
    """Max abs and relative (max|got - ref| / max|ref|) error per quantity over all compares."""

    def __init__(self) -> None:
        self.q: dict[str, list[float]] = {}  # quantity -> [abs, rel, rel of torch float32]

    def add(self, what: str, got: Any, ref: Any, ref32: Any = None) -> None:
        """``ref32``: the original run in float32, whose relative error is kept beside ours."""
        ref = np.asarray(ref, np.float64)
        old = self.q.setdefault(what, [0.0, 0.0, float("nan")])
        a, r = _err(got, ref)
        old[0], old[1] = max(old[0], a), max(old[1], r)
        if ref32 is not None:
            r32 = _err(ref32, ref)[1]
            old[2] = r32 if np.isnan(old[2]) else max(old[2], r32)


def _err(got: Any, ref: np.ndarray) -> tuple[float, float]:
    got = np.asarray(got, np.float64).reshape(ref.shape)
    a = float(np.max(np.abs(got - ref))) if ref.size else 0.0
    return a, (a / max(float(np.max(np.abs(ref))), 1e-300) if a else 0.0)


def tokens(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Tokens with channel means 5-15x their spread (either sign), float32-representable. The
    channels' means and spreads are the same at every step (one data distribution: running
    statistics can follow it), the noise is ``rng``'s."""
    c = shape[-1]
    fixed = np.random.default_rng(c)
    spread = fixed.uniform(0.5, 2.0, c)
    mean = spread * fixed.uniform(5, 15, c) * fixed.choice([-1, 1], c)
    return (mean + spread * rng.normal(size=shape)).astype(np.float32).astype(np.float64)


def f32(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, np.float32).astype(np.float64)


def t2n(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy().astype(np.float64)


def _get(tree: Any, path: tuple[str, ...]) -> Any:
    for k in path:
        tree = tree[k]
    return tree


def _set(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for k in path[:-1]:
        tree = tree[k]
    tree[path[-1]] = value


def _unfreeze(tree: Any) -> Any:
    return jax.tree.map(lambda a: a, dict(tree)) if tree else {}


def to_jax_layout(t: np.ndarray, shape: tuple[int, ...], transpose: bool) -> np.ndarray:
    return (t.T if transpose else t).reshape(shape)


def jax_step(module: Any, takes_step: bool) -> Callable:
    """One train step through ``train_grads`` (the rule the train step runs), the input riding
    along with the params so that dx comes back; the progressive norm's sown weight too."""
    @jax.jit
    def step(params, stats, x, w, step_no):
        def apply_fn(v):
            p, xx = v["params"]
            kw = {"step": step_no} if takes_step else {}
            out, mut = module.apply({"params": p, **({"batch_stats": v["batch_stats"]}
                                                     if "batch_stats" in v else {})},
                                    xx, train=True, mutable=["batch_stats", "schedule"], **kw)
            return (out, mut.get("schedule", {})), mut
        _, (gp, gx), new_stats, (y, sched) = train_grads(
            apply_fn, (params, x), stats, lambda o: jnp.sum(w * o[0]))
        return y, gp, gx, new_stats, sched
    return step


def compare(tmod: torch.nn.Module, cfg: dict, *, dim: int, heads: int = 2,
            shape: tuple[int, int, int], params: dict[tuple[str, ...], str],
            stats: dict[tuple[str, ...], str] = {}, steps: int = 1, grid: tuple | None = None,
            call: Callable | None = None, transposed: tuple[str, ...] = (),
            lam: Callable | None = None, fold: bool = False, seed: int = 0,
            inputs: Callable | None = None, param_init: Callable | None = None,
            random_init: tuple[str, ...] = (), groups: int = 1) -> Errors:
    """The original ``tmod`` (float64) and this project's norm ``cfg`` on the same inputs.

    params/stats: jax path -> torch attribute name (layouts differ by a reshape, or a transpose
    for the names in ``transposed``). ``call(tmod, x)`` runs the original (default tmod(x));
    ``lam(tmod)`` is the original's mixing weight of the coming train forward (progressive);
    ``fold``: the project's ``inference_affine`` against the original's eval output too;
    ``inputs(rng, step)`` replaces ``tokens`` (an outlier step); ``param_init(name, tensor,
    rng)`` the random parameter values (default: scales 1 + 0.3 N, the rest 0.3 N). First the
    initial values of every mapped parameter and state are compared (``random_init``: the torch
    names drawn at random, left out). ``groups`` > 1: that many copies of the original, one per
    slice of the batch (``Ghost``), against ``stats_group_size=B/groups``."""
    rng = np.random.default_rng(seed)
    call = call or (lambda m, x: m(x))
    if groups > 1:
        tmod, call = Ghost(tmod, groups, call), (lambda m, x: m(x))
        cfg = {**cfg, "stats_group_size": shape[0] // groups}
        params = {k: "copies.0." + v for k, v in params.items()}
        transposed = tuple("copies.0." + v for v in transposed)
    inputs = inputs or (lambda r, i: tokens(r, shape))
    module = norms.create(cfg, dim=dim, num_heads=heads, grid=grid, num_prefix_tokens=0)
    takes_step = getattr(type(module), "TAKES_STEP", False)
    x0 = jnp.asarray(inputs(np.random.default_rng(seed + 99), -1))
    v = module.init(jax.random.PRNGKey(0), x0, train=True, **({"step": 0} if takes_step else {}))
    jp, js = _unfreeze(v["params"]), _unfreeze(v.get("batch_stats", {}))
    tnamed = dict(tmod.named_parameters())
    err = Errors()
    for tree, names, value in ((jp, params, lambda m, n: t2n(tnamed[n])), (js, stats, buffer)):
        for path, tname in names.items():  # the initial values
            if tname not in random_init:
                sh = np.shape(_get(tree, path))
                err.add("init (params, state)", _get(tree, path),
                        to_jax_layout(value(tmod, tname), sh, tname in transposed))
    with torch.no_grad():  # the same random parameters on both sides
        for path, tname in params.items():
            t = tnamed[tname]
            if param_init is not None:
                val = param_init(tname, t2n(t), rng)
            elif "weight" in tname or tname in ("a", "alpha", "scale"):
                val = 1 + 0.3 * rng.normal(size=t.shape)
            else:
                val = 0.3 * rng.normal(size=t.shape)
            t.copy_(torch.from_numpy(f32(val)))
            _set(jp, path, jnp.asarray(to_jax_layout(f32(val), np.shape(_get(jp, path)),
                                                     tname in transposed), jnp.float32))
        for tname, t in tnamed.items():  # parameters the project does not have
            if tname not in params.values():
                t.copy_(torch.from_numpy(f32(0.3 * rng.normal(size=t.shape))))
    step = jax_step(module, takes_step)
    t32 = copy.deepcopy(tmod).float()  # the original in float32: float32's own error, for scale
    tnamed32 = dict(t32.named_parameters())
    tmod.train()
    t32.train()
    for i in range(steps):
        x = inputs(rng, i)
        w = rng.normal(size=shape)
        if lam is not None:
            ref_lam = lam(tmod)
        yt, gxt, gpt = _torch_step(tmod, tnamed, call, x, w)
        y32, gx32, gp32 = _torch_step(t32, tnamed32, call, x, w, torch.float32)
        y, gp, gx, js, sched = step(jp, js, jnp.asarray(x), jnp.asarray(w), jnp.asarray(i))
        err.add("forward (train)", y, yt, y32)
        err.add("dx", gx, gxt, gx32)
        for path, tname in params.items():
            sh = np.shape(_get(gp, path))
            err.add("d" + "/".join(path), _get(gp, path),
                    *(to_jax_layout(g[tname], sh, tname in transposed) for g in (gpt, gp32)))
        for path, tname in stats.items():
            sh = np.shape(_get(js, path))
            err.add("/".join(path), _get(js, path), buffer(tmod, tname).reshape(sh),
                    buffer(t32, tname).reshape(sh))
        if lam is not None:
            err.add("lambda", jax.tree.leaves(sched)[0], ref_lam)
    tmod.eval()
    t32.eval()
    x = inputs(rng, steps)
    with torch.no_grad():
        yt = t2n(call(tmod, torch.from_numpy(x.copy())))
        with _default_dtype(torch.float32):
            y32 = t2n(call(t32, torch.from_numpy(x.astype(np.float32))))
    kw = {"step": jnp.asarray(steps)} if takes_step else {}
    y = module.apply({"params": jp, **({"batch_stats": js} if js else {})}, jnp.asarray(x),
                     train=False, **kw)
    err.add("forward (eval)", y, yt, y32)
    if fold:
        a, c = module.inference_affine(jp, js)
        err.add("eval fold a*x+c", np.asarray(a, np.float64) * x + np.asarray(c, np.float64), yt)
    return err


class Ghost(torch.nn.Module):
    """``groups`` copies of an original sharing its parameters, each normalising its own slice of
    the batch: one GPU each under DistributedDataParallel, whose gradients add up here (the sum
    of the losses; DDP averages, a constant factor). Against ``stats_group_size``, whose state is
    the mean over groups: so before each forward every copy's floating-point state is set
    to the mean over the copies (DDP's default broadcast would give rank 0's instead)."""

    def __init__(self, mod: torch.nn.Module, groups: int, call: Callable) -> None:
        super().__init__()
        self.copies = torch.nn.ModuleList([mod] + [copy.deepcopy(mod) for _ in range(groups - 1)])
        for c in self.copies[1:]:
            for name, p in mod.named_parameters():
                owner, _, attr = name.rpartition(".")
                setattr(c.get_submodule(owner) if owner else c, attr, p)
        self.call = call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            for name, b in self.copies[0].named_buffers():
                if b.is_floating_point():
                    mean = torch.stack([dict(c.named_buffers())[name] for c in self.copies]).mean(0)
                    for c in self.copies:
                        dict(c.named_buffers())[name].copy_(mean)
        parts = x.chunk(len(self.copies))
        return torch.cat([self.call(c, xs) for c, xs in zip(self.copies, parts)])


def buffer(tmod: torch.nn.Module, name: str) -> np.ndarray:
    """An original's state; of a ``Ghost``, the mean over its copies (this project's state of
    ghost groups; the references keep rank 0's)."""
    if isinstance(tmod, Ghost):
        return np.mean([t2n(dict(c.named_buffers())[name]) for c in tmod.copies], axis=0)
    return t2n(dict(tmod.named_buffers())[name])


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    """Tensors an original makes inside its forward (DTN's offsets) in the module's dtype."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _torch_step(tmod: torch.nn.Module, named: dict, call: Callable, x: np.ndarray, w: np.ndarray,
                dtype: torch.dtype = torch.float64) -> tuple[np.ndarray, np.ndarray, dict]:
    """The original's train forward and backward of sum(w * y): y, dx, {param name: grad}."""
    with _default_dtype(dtype):
        xt = torch.from_numpy(x).to(dtype).requires_grad_(True)
        for t in named.values():
            t.grad = None
        yt = call(tmod, xt)
        (yt * torch.from_numpy(w).to(dtype)).sum().backward()
    grads = {k: np.zeros(t.shape) if t.grad is None else t2n(t.grad) for k, t in named.items()}
    return t2n(yt), t2n(xt.grad), grads


# ---------------------------------------------------------------- the cases
DTN_DIR = "models/normkit/norms/"
BC = (4, 10, 12)  # (B, T, C) of the token norms without a grid


def _pos_init(name: str, t: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """DTN: the local init the original made, plus noise (random weights over offsets up to 338
    would give a one-hot P); other parameters as default."""
    if name == "pos_proj.weight":
        return t + 0.05 * rng.normal(size=t.shape)
    if "weight" in name:
        return 1 + 0.3 * rng.normal(size=t.shape)
    return 0.3 * rng.normal(size=t.shape)


def dtn(src: str, grid: int = 14, only_var: bool = False) -> Errors:
    m = load(src, "DTN", DTN_DIR + "dtn.py")
    c, h = 16, 4
    tmod = m.DTN(c, group_num=h, resolution=(grid, grid), only_var=only_var)
    p = {("scale",): "weight", ("bias",): "bias", ("var_gate",): "var_norm_weight",
         ("pos_proj",): "pos_proj.weight"}
    if not only_var:
        p[("mean_gate",)] = "mean_norm_weight"
    # position_init 'local': the layer's own init (NormSelect's DTN); the released ViT re-inits
    # every Linear afterwards, which the project's default 'reference' reproduces (docs/norms.md).
    cfg = {"name": "dtn_var" if only_var else "dtn", "position_init": "local"}
    return compare(tmod, cfg, dim=c, heads=h,
                   shape=(2, grid * grid, c), grid=(grid, grid), params=p, steps=2,
                   transposed=("pos_proj.weight",), param_init=_pos_init)


def powernorm_reference(src: str, groups: int = 1, steps: int = 6) -> Errors:
    m = load(src, "powernorm", "fairseq/modules/norms/mask_powernorm.py")
    tmod = m.MaskPowerNorm(BC[2], warmup_iters=3)  # one group, as the reference's default
    return compare(tmod, {"name": "powernorm", "warmup": 3, "groups": 1}, dim=BC[2], shape=BC,
                   groups=groups,
                   params={("scale",): "weight", ("bias",): "bias"},
                   stats={("running_phi",): "running_phi", ("ema_gz",): "ema_gz", ("t",): "iters"},
                   steps=steps, call=lambda mod, x: mod(x.transpose(0, 1)).transpose(0, 1))


def powernorm_dtn(src: str, groups: int = 1, steps: int = 6) -> Errors:
    # Stub: the DTN copy's forward calls PowerFunction, which the file renamed PowerFunction_PN
    # (docs/norms.md: it cannot train as released); bound to that class, nothing else changes.
    m = load(src, "DTN", DTN_DIR + "us_powernorm.py")
    m.PowerFunction = m.PowerFunction_PN
    tmod = m.PowerNorm(BC[2], group_num=3, warmup_iters=3)
    return compare(tmod, {"name": "powernorm", "warmup": 3, "groups": "heads", "backward": "dtn"},
                   dim=BC[2], heads=3, shape=BC, params={("scale",): "weight", ("bias",): "bias"},
                   stats={("running_phi",): "running_phi", ("ema_gz",): "ema_gz", ("t",): "iters"},
                   steps=steps, groups=groups)


UN_STATS = {("running_var",): "running_var", ("ema_gz",): "ema_gz", ("buffer_x2",): "buffer_x2",
            ("buffer_gz",): "buffer_gz", ("t",): "iters", ("skips",): "skip_counter"}


def unified(src: str, window: Any = 4, filtration: bool = False, groups: int = 1,
            steps: int = 1010) -> Errors:
    """1010 steps: the original's ratio warm-up (1000) is a constant, so the r-scaled backward
    starts at step 1001. With filtration, steps 1003 and 1006 have one channel 30x larger."""
    m = load(src, "Unified-Normalization",
             "image_classification/models/unified_normalization/unified_normalization.py")
    tmod = m.UN1d(BC[2], window_size=window, warmup_iters=6, outlier_filtration=filtration)

    def inputs(rng, i):
        x = tokens(rng, BC)
        if filtration and i in (1002, 1005):
            x[..., 0] *= 30
        return x
    return compare(tmod, {"name": "unified", "window": window, "warmup": 6,
                          "outlier_filtration": filtration}, dim=BC[2], shape=BC,
                   params={("scale",): "weight", ("bias",): "bias"}, stats=UN_STATS, steps=steps,
                   inputs=inputs, groups=groups)


def repbn(src: str, groups: int = 1) -> Errors:
    m = load(src, "SLAB", "classification/models/prepbn.py")
    return compare(m.RepBN(BC[2]), {"name": "repbn"}, dim=BC[2], shape=BC, groups=groups,
                   params={("eta",): "alpha", ("bn", "scale"): "bn.weight", ("bn", "bias"): "bn.bias"},
                   stats={("bn", "mean"): "bn.running_mean", ("bn", "var"): "bn.running_var"},
                   steps=5, fold=True)


def progressive(src: str) -> Errors:
    """SLAB's LinearNorm(LayerNorm eps 1e-6 -> RepBN), warm 2, 5 decay steps, r0 0.8: lambda
    step by step through the warm-up, the decay and after it."""
    m = load(src, "SLAB", "classification/models/prepbn.py")
    ln = functools.partial(torch.nn.LayerNorm, eps=1e-6)
    tmod = m.LinearNorm(BC[2], norm1=ln, norm2=m.RepBN, warm=2, step=5, r0=0.8)

    def lam(mod):
        return 1.0 if mod.warm > 0 else float(mod.r0 * mod.iter / mod.total_step)
    cfg = {"name": "progressive", "n1": {"name": "layernorm", "epsilon": 1e-6}, "n2": "repbn",
           "warmup_steps": 2, "decay_steps": 5, "r0": 0.8}
    return compare(tmod, cfg, dim=BC[2], shape=BC,
                   params={("n1", "scale"): "norm1.weight", ("n1", "bias"): "norm1.bias",
                           ("n2", "eta"): "norm2.alpha", ("n2", "bn", "scale"): "norm2.bn.weight",
                           ("n2", "bn", "bias"): "norm2.bn.bias"},
                   stats={("n2", "bn", "mean"): "norm2.bn.running_mean",
                          ("n2", "bn", "var"): "norm2.bn.running_var"},
                   steps=9, lam=lam, fold=True)


def batchnorm(src: str, groups: int = 1) -> Errors:
    m = load(src, "DTN", DTN_DIR + "us_instancenorm.py")
    return compare(m.BatchNorm_(BC[2]), {"name": "batchnorm", "unbiased_running_var": True},
                   dim=BC[2], shape=BC, groups=groups, params={("scale",): "weight", ("bias",): "bias"},
                   stats={("mean",): "bn.running_mean", ("var",): "bn.running_var"}, steps=5,
                   fold=True)


def _stateless(src: str, repo: str, path: str, build: Callable, cfg: dict, params: dict,
               heads: int = 2, inputs: Callable | None = None) -> Errors:
    tmod = build(load(src, repo, path))
    return compare(tmod, cfg, dim=BC[2], heads=heads, shape=BC, params=params, inputs=inputs)


def _unsaturated(rng: np.random.Generator, i: int) -> np.ndarray:
    """DyT/Derf: tokens a tenth of the size (channel means 0.25-3), so that alpha * x spans tanh's
    and erf's curved part instead of their flat tails, where every gradient is ~0."""
    return f32(0.1 * tokens(rng, BC))


AFFINE = {("scale",): "weight", ("bias",): "bias"}


def layernorm(src: str) -> Errors:
    return _stateless(src, "DTN", DTN_DIR + "us_layernorm.py", lambda m: m.LayerNorm(BC[2]),
                      {"name": "layernorm", "epsilon": 1e-5}, AFFINE)


def instancenorm(src: str) -> Errors:
    return _stateless(src, "DTN", DTN_DIR + "us_instancenorm.py", lambda m: m.InsNorm(BC[2]),
                      {"name": "instancenorm", "unbiased": True}, AFFINE)


def groupnorm(src: str) -> Errors:
    return _stateless(src, "DTN", DTN_DIR + "us_groupnorm.py",
                      lambda m: m.GroupNorm_(3, BC[2]), {"name": "groupnorm", "groups": "heads"},
                      AFFINE, heads=3)


def scalenorm(src: str) -> Errors:
    return _stateless(src, "DTN", DTN_DIR + "us_scalenorm.py", lambda m: m.ScaleNorm(BC[2]),
                      {"name": "scalenorm", "per_channel": True}, {("g",): "scale"})


def dyt(src: str) -> Errors:
    return _stateless(src, "DyT", "dynamic_tanh.py", lambda m: m.DynamicTanh(BC[2], True),
                      {"name": "dyt"}, {("alpha",): "alpha", **AFFINE}, inputs=_unsaturated)


def derf(src: str) -> Errors:
    return _stateless(src, "Derf", "ViT/dynamic_erf.py", lambda m: m.Dynamic_erf(BC[2], True),
                      {"name": "derf"}, {("alpha",): "alpha", ("shift",): "shift", **AFFINE},
                      inputs=_unsaturated)


def learnable_scaler(src: str) -> Errors:
    # Only the class: the file is part of a vendored timm whose relative imports need the package.
    cls = load_class(src, "LearnableScaler", "timm/layers/norm.py", "LearnableScaler")
    return compare(cls(BC[2]), {"name": "learnable_scaler"}, dim=BC[2], shape=BC,
                   params={("scale",): "a", ("bias",): "b"}, random_init=("a",))


def rescale(src: str, steps: int = 10) -> Errors:
    """10 train calls cross the 8-call warm-up. With 3, the eval forward differs on purpose: the
    original's eval also updates mu0 during its first 8 calls, here eval never changes state."""
    m = load(src, "RescaleViT", "models/rescale_mapping.py")
    return compare(m.Bias1D(BC[2]), {"name": "rescale"}, dim=BC[2], shape=BC,
                   params={("bias",): "_bias"}, stats={("mu0",): "init_mean", ("count",): "count"},
                   steps=steps, fold=steps >= 8)


# name -> (repository, function): the table's rows in order.
CASES: dict[str, tuple[str, Callable[[str], Errors]]] = {
    "dtn": ("DTN", dtn),
    "dtn grid 28 (pooled)": ("DTN", functools.partial(dtn, grid=28)),
    "dtn_var": ("DTN", functools.partial(dtn, only_var=True)),
    "unified": ("Unified-Normalization", unified),
    "unified (3,2) filtration": ("Unified-Normalization",
                                 functools.partial(unified, window=(3, 2), filtration=True)),
    "unified ghost 2x2 (3,2) filtration": ("Unified-Normalization", functools.partial(
        unified, window=(3, 2), filtration=True, groups=2)),
    "powernorm": ("powernorm", powernorm_reference),
    "powernorm DTN copy": ("DTN", powernorm_dtn),
    "powernorm ghost 2x2": ("powernorm", functools.partial(powernorm_reference, groups=2)),
    "powernorm DTN copy ghost 2x2": ("DTN", functools.partial(powernorm_dtn, groups=2)),
    "repbn": ("SLAB", repbn),
    "progressive LN->RepBN": ("SLAB", progressive),
    "repbn ghost 2x2": ("SLAB", functools.partial(repbn, groups=2)),
    "batchnorm": ("DTN", batchnorm),
    "batchnorm ghost 2x2": ("DTN", functools.partial(batchnorm, groups=2)),
    "layernorm": ("DTN", layernorm),
    "instancenorm": ("DTN", instancenorm),
    "groupnorm": ("DTN", groupnorm),
    "scalenorm": ("DTN", scalenorm),
    "dyt": ("DyT", dyt),
    "derf": ("Derf", derf),
    "learnable_scaler": ("LearnableScaler", learnable_scaler),
    "rescale": ("RescaleViT", rescale),
    "rescale eval after 3 calls (documented difference)": (
        "RescaleViT", functools.partial(rescale, steps=3)),
}
