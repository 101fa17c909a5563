"""Dynamic Token Normalization, DTN (Shao et al., ICLR 2022).

Per token: mu = lam_mu * mu_LN + (1 - lam_mu) * mu_IN, var likewise, where the IN statistics of
head h are weighted averages over source tokens with weights P^h = softmax over sources of a
learned linear map of the relative grid offset (dx, dy, dx^2 + dy^2). P does not depend on x:
it is computed once per call and the IN statistics of the whole batch are one einsum.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, Mapping, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from normvit_jax.norms import dtn_half, dtn_moments, dtn_pallas
from normvit_jax.norms.dtn_moments import position_weights, relative_offsets  # noqa: F401
from normvit_jax.norms._common import PER_TOKEN_STATS, NormContext, resolve_groups

POSITION_INITS = ("reference", "local")
MOMENTS_DTYPES = (None, "float32", "bfloat16", "float16")
KERNELS = ("xla", "pallas")


def position_init(heads: int, local: bool, strength: float) -> Callable:
    """Kernel (3, H) of the offset -> logit map. 'local': ConViT's init for the first k^2 heads
    (k = floor(sqrt(H))), [2(h2-c), 2(h1-c), -1] for head h1 + k*h2, c = (k-1)/2, the whole
    matrix times ``strength``; other heads and 'reference' (the released ViT re-initialises every
    Linear): N(0, 0.02^2)."""
    def init(key: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.Array:
        w = 0.02 * jax.random.normal(key, shape, dtype)
        if not local:
            return w
        k = int(math.isqrt(heads))
        center = (k - 1) / 2
        fixed = np.zeros(shape, np.float32)
        for h1 in range(k):
            for h2 in range(k):
                fixed[:, h1 + k * h2] = [2 * (h2 - center), 2 * (h1 - center), -1.0]
        is_local = np.arange(heads) < k * k
        return jnp.where(is_local, jnp.asarray(fixed, dtype), w) * strength
    return init


class DTN(nn.Module):
    """Options: heads (default: the model's), epsilon (1e-5, also the RMS pre-scaling's),
    mix_mean (False: the reference's 'dtn_var', mu = mu_LN), ln_unbiased (reference: True),
    position_init ('reference' = near-uniform after the released ViT's re-init, or 'local'),
    locality_strength, pool_size (14: grids above 14 that are multiples of it are average-pooled
    to it for the IN statistics as the reference does; None: always exact), moments_dtype (None:
    the input's dtype; the IN moments' matmul operands, accumulated in float32: 'float32' is exact
    float32, 'bfloat16'/'float16' run on a GPU's or TPU's matrix units), recompute (None: when the
    moments are half precision; True: the backward recomputes the forward and keeps only the input;
    half-precision moments without pooling always do: norms/dtn_half.py writes that case out),
    kernel ('xla', or 'pallas': on that half-precision path without pooling, for head widths that
    are powers of two >= 16, forward and backward in Pallas kernels, norms/dtn_pallas.py, Triton
    on a GPU and Pallas's slow interpreter on a CPU; in every other case, a TPU included, XLA's,
    the same function),
    pallas_tiling (None: the kernels' defaults; 'F:B', F the forward's and B the backward's
    'channels/targets/warps', e.g. '32/64/8:16/16/8': how a program cuts its work, for tuning
    on a GPU; powers of two).

    Prefix (class) tokens get plain LN statistics; the reference instead keeps the class token out
    of its DTN blocks (``model.cls_token_at_block``).
    """

    CONTEXT_FIELDS = ("grid", "num_prefix_tokens")  # from the NormContext, not options
    NOT_FOLDED = PER_TOKEN_STATS  # reparam's reason

    heads: int
    grid: tuple[int, int]
    num_prefix_tokens: int = 0
    epsilon: float = 1e-5
    mix_mean: bool = True
    ln_unbiased: bool = True
    position_init: str = "reference"
    locality_strength: float = 1.0
    pool_size: int | None = 14
    moments_dtype: str | None = None
    recompute: bool | None = None
    kernel: str = "xla"
    pallas_tiling: str | None = None

    @classmethod
    def from_config(cls, opts: Mapping[str, Any], ctx: NormContext, name: str | None = None):
        norm_name = ctx.norm
        opts = dict(opts)
        opts["heads"] = resolve_groups(norm_name, "heads", opts.get("heads"), ctx.dim, ctx.num_heads)
        if ctx.grid is None or len(ctx.grid) != 2 or ctx.grid[0] != ctx.grid[1] or ctx.grid[0] < 1:
            raise ValueError(f"norm {norm_name!r} in slot {ctx.slot!r}: grid={ctx.grid!r} is not "
                             "accepted; accepted: a square patch grid (n, n) of the tokens")
        if opts.get("position_init", "reference") not in POSITION_INITS:
            raise ValueError(f"norm {norm_name!r}: position_init={opts['position_init']!r} is not "
                             f"accepted; accepted: {list(POSITION_INITS)}")
        pool = opts.get("pool_size", 14)
        if pool is not None and (not isinstance(pool, int) or pool < 1):
            raise ValueError(f"norm {norm_name!r}: pool_size={pool!r} is not accepted; accepted: "
                             "None or a positive int")
        if opts.get("moments_dtype") not in MOMENTS_DTYPES:
            raise ValueError(f"norm {norm_name!r}: moments_dtype={opts['moments_dtype']!r} is not "
                             f"accepted; accepted: {list(MOMENTS_DTYPES)}")
        if opts.get("recompute") is not None and not isinstance(opts["recompute"], bool):
            raise ValueError(f"norm {norm_name!r}: recompute={opts['recompute']!r} is not "
                             "accepted; accepted: None (on when the moments are half precision), "
                             "True or False")
        if opts.get("pallas_tiling") is not None:
            dtn_pallas.parse_tiling(opts["pallas_tiling"], norm_name)  # fail early
        if opts.get("kernel", "xla") not in KERNELS:
            raise ValueError(f"norm {norm_name!r}: kernel={opts['kernel']!r} is not accepted; "
                             f"accepted: {list(KERNELS)}")
        return cls(grid=tuple(ctx.grid), num_prefix_tokens=ctx.num_prefix_tokens, name=name, **opts)

    def _stat_side(self) -> int:
        side = self.grid[0]
        if self.pool_size and side > self.pool_size and side % self.pool_size == 0:
            return self.pool_size
        return side

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        b, t, c = x.shape
        side, pre, h = self.grid[0], self.num_prefix_tokens, self.heads
        if t != pre + side * side:
            raise ValueError(f"norm 'dtn': got {t} tokens, but grid={self.grid} with "
                             f"num_prefix_tokens={pre} needs {pre + side * side}; accepted: "
                             "prefix tokens followed by the row-major patch grid")
        params = {
            "scale": self.param("scale", nn.initializers.ones, (c,), jnp.float32),
            "bias": self.param("bias", nn.initializers.zeros, (c,), jnp.float32),
            "pos_proj": self.param("pos_proj", position_init(h, self.position_init == "local",
                                                             self.locality_strength),
                                   (3, h), jnp.float32),
            "var_gate": self.param("var_gate", nn.initializers.zeros, (h,), jnp.float32)}
        if self.mix_mean:
            params["mean_gate"] = self.param("mean_gate", nn.initializers.zeros, (h,), jnp.float32)
        moments_dtype = jnp.dtype(self.moments_dtype or x.dtype)
        if moments_dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
            moments_dtype = jnp.dtype(jnp.float32)
        recompute = self.recompute
        if recompute is None:  # half-precision training: memory matters more than a second forward
            recompute = moments_dtype != jnp.float32
        cfg = _Static(side, pre, h, self._stat_side(), self.epsilon, self.ln_unbiased,
                      self.mix_mean, moments_dtype,
                      dtn_pallas.parse_tiling(self.pallas_tiling) if self.pallas_tiling else None)
        half_path = moments_dtype != jnp.float32 and cfg.stat_side == side
        backend = jax.default_backend()
        if self.kernel == "pallas" and half_path and dtn_pallas.fits(c // h, backend):
            # the same function in Pallas kernels (norms/dtn_pallas.py); where they do not apply
            # (float32 moments: evaluation, export; pooling; other head widths; a TPU) XLA's
            return dtn_pallas.dtn(x, params, cfg)
        if half_path:
            # the half-precision path on the matrix units, written out with its backward
            # (norms/dtn_half.py): the backward keeps the input and two (B, 1, C) shifts
            return dtn_half.dtn(x, params, cfg)
        fn = functools.partial(_dtn, cfg=cfg)
        # Recomputed in the backward, DTN keeps only its input (as LayerNorm): its float32
        # per-channel statistics would otherwise stay alive from the forward to the backward.
        return (jax.checkpoint(fn) if recompute else fn)(x, params)


class _Static(NamedTuple):
    side: int
    pre: int
    heads: int
    stat_side: int
    epsilon: float
    ln_unbiased: bool
    mix_mean: bool
    moments_dtype: Any
    tiling: Any = None  # kernel='pallas': (forward, backward) dtn_pallas.Tiling, None: defaults


def _dtn(x: jax.Array, params: Mapping[str, jax.Array], cfg: _Static) -> jax.Array:
    """The DTN function of ``x`` (B, T, C) given its parameters; ``cfg`` holds the static options."""
    b, t, c = x.shape
    side, pre, h = cfg.side, cfg.pre, cfg.heads
    d = c // h
    xh = x.astype(jnp.float32).reshape(b, t, h, d)
    s1, s2 = jnp.sum(xh, -1, keepdims=True), jnp.sum(jnp.square(xh), -1, keepdims=True)
    rs = jax.lax.rsqrt(s2 / d + cfg.epsilon)  # per-head RMS pre-scaling (group_rms_scale)
    xs = (xh * rs).reshape(b, t, c)
    # LN statistics of xs from the per-head sums of x and x^2, not from a pass over xs (for which
    # XLA:GPU stored xs in float32): E[xs^2] - E[xs]^2 with E[xs^2] ~ 1 (RMS 1 per head), so
    # float32 holds the variance to ~1e-7, relatively worse only for a token whose channels
    # are all nearly equal (a variance far below 1, which the epsilon then dominates).
    mu_ln = jnp.sum(rs * s1, axis=2) / c
    m2_ln = jnp.sum(rs * rs * s2, axis=2) / c
    var_ln = jnp.maximum(m2_ln - jnp.square(mu_ln), 0.0) * (c / (c - 1 if cfg.ln_unbiased else c))

    # Position-aware IN statistics, once per call: P (H, N_src, N_tgt), softmax over sources.
    s = cfg.stat_side
    k = side // s
    p = position_weights(params["pos_proj"], s)
    patches = xs[:, pre:]
    if k > 1:  # the reference's average pooling to s x s (statistics of the pooled tokens)
        patches = patches.reshape(b, s, k, s, k, c).mean(axis=(2, 4)).reshape(b, s * s, c)
    # Shift by the token mean first (P sums to 1 over sources, so the variance is unchanged):
    # E[x^2] - E[x]^2 then cancels far less, in float32 and more so in bfloat16.
    # The shift cancels exactly (in value and gradient), so no gradient flows through it.
    # The squares are shifted by their token mean too: both matmul operands are then centred,
    # which is what keeps bfloat16 operands accurate (their rounding is relative to the values)
    # and the softmax's backward of dP, which subtracts dP's mean, free of a large common part.
    shift = jax.lax.stop_gradient(jnp.mean(patches, axis=1, keepdims=True))
    ph = (patches - shift).reshape(b, s * s, h, d)
    sq = jnp.square(ph)
    # the squares' token mean from the same pass as the shift (E[x^2] - E[x]^2 over tokens):
    # only a centring constant, exact whatever its rounding
    sq_shift = jax.lax.stop_gradient(jnp.maximum(
        jnp.mean(jnp.square(patches), axis=1, keepdims=True) - jnp.square(shift), 0.0)
        ).reshape(b, 1, h, d)
    moments = dtn_moments.in_moments(jnp.concatenate([ph, sq - sq_shift], -1), p,
                                     cfg.moments_dtype)
    mu_in, m2_in = jnp.split(moments, 2, axis=-1)
    m2_in = m2_in + sq_shift
    var_in = jnp.maximum(m2_in - jnp.square(mu_in), 0.0)  # >= 0 exactly; rounding may say otherwise
    mu_in = mu_in + shift.reshape(b, 1, h, d)
    if k > 1:  # each pooled cell's statistics repeated over its k x k block
        up = lambda a: jnp.repeat(jnp.repeat(a.reshape(b, s, s, c), k, 1), k, 2)
        mu_in, var_in = up(mu_in), up(var_in)
    mu_in, var_in = mu_in.reshape(b, side * side, c), var_in.reshape(b, side * side, c)

    per_channel = lambda gate: jnp.repeat(jax.nn.sigmoid(gate), d)
    lam_var = per_channel(params["var_gate"])
    var = lam_var * var_ln[:, pre:] + (1 - lam_var) * var_in
    if cfg.mix_mean:
        lam_mu = per_channel(params["mean_gate"])
        mu = lam_mu * mu_ln[:, pre:] + (1 - lam_mu) * mu_in
    else:
        mu = jnp.broadcast_to(mu_ln[:, pre:], var.shape)
    if pre:  # class token: plain LN statistics
        mu = jnp.concatenate([jnp.broadcast_to(mu_ln[:, :pre], (b, pre, c)), mu], axis=1)
        var = jnp.concatenate([jnp.broadcast_to(var_ln[:, :pre], (b, pre, c)), var], axis=1)
    y = (xs - mu) * jax.lax.rsqrt(var + cfg.epsilon)
    return (y * params["scale"] + params["bias"]).astype(x.dtype)


class DTNVar(DTN):
    """The reference's 'dtn_var': only the variance is mixed, mu = mu_LN."""

    mix_mean: bool = False
