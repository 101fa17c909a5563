"""How ``benchmarks.originals`` runs an original PyTorch module next to this project's norm.

Imports torch: ``benchmarks.originals`` imports this file (through originals_cases) only once
torch has imported. ``load`` imports one file of an original repository by path; ``compare``
gives the original and this project's norm the same random parameters and runs both in train
mode for some steps (forward, gradients of sum(w * y) for one random cotangent w, the state
after each step), then in eval mode. The originals run in float64; this project's norms compute
in float32 as they always do (docs/norms.md, Common rules), on the same float32-representable
inputs, so a few 1e-7..1e-5 of relative error is float32's and a wrong rule shows as 1e-3 or more.
"""
from __future__ import annotations

import ast
import contextlib
import copy
import importlib.util
import os
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
    name = f"_orig_{repo}_{os.path.basename(path)[:-3]}"
    spec = importlib.util.spec_from_file_location(name, full)
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
