"""Progressive replacement of one norm by another: lam * N1(x) + (1 - lam) * N2(x).

SLAB's ``LinearNorm`` ("PRepBN", xinghaochen/SLAB classification/models/prepbn.py) with LayerNorm
as N1 and RepBN as N2. Here N1 and N2 are any two registered norms, and lam is a function of the
*global train step* (the reference counts forwards in each module), which the train step passes as
``model.apply(..., step=state.step)``: identical on every device, exact after a resume.

Schedule (step 0 is the first train step): while ``step < warmup_steps`` only N1 runs (N2 is not
called, its running statistics do not move); then with k = step - warmup_steps, D = decay_steps,
``linear``: lam = r0 * max(0, 1 - k/D); ``cosine``: lam = r0 * (1 + cos(pi * min(k, D)/D)) / 2.
The train loop compiles one train step per phase of the schedules (train/phases.py) and tells
each its steps as ``phase=(first, end)``: a phase inside the warm-up runs N1 alone and one after
the hand-over N2 alone (lam is 0 there: N1 is not computed at all), with no branch and no host
sync; ``phase=None`` (any step) computes what the step number asks for.
Evaluation (``eval_mode``): 'n2' (the reference: N2 alone, which folds when N2 does) or 'mixture'
(lam at the given step times N1 plus the rest times N2). Each train forward sows N1's weight in
the ``schedule`` collection (the train step logs it).
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.core import FrozenDict

from normvit_jax.norms._common import NormContext
from normvit_jax.norms.token_channel import TokenMix

SCHEDULES = ("linear", "cosine")
EVAL_MODES = ("n2", "mixture")
_DEFAULT_N1 = FrozenDict({"name": "layernorm", "epsilon": 1e-6})
_DEFAULT_N2 = FrozenDict({"name": "repbn"})


def _norm_cfg(value: Any) -> FrozenDict:
    from normvit_jax.norms import registry  # the registry imports this module
    return FrozenDict(registry.as_dict(value))


def handover_note(norm_cfgs: list[Any], total_steps: int) -> str | None:
    """One line when a progressive norm that evaluates N2 alone ends its hand-over after the
    run's last step (training logs it at start): evaluation would then use an N2 that carried
    only part of the training forward. None otherwise."""
    for cfg in norm_cfgs:
        cfg = cfg.to_dict() if hasattr(cfg, "to_dict") else cfg  # a ConfigDict
        if not isinstance(cfg, Mapping) or cfg.get("name") != "progressive":
            continue
        if cfg.get("eval_mode", "n2") != "n2":
            continue
        ws = int(cfg.get("warmup_steps", Progressive.warmup_steps))
        ds = int(cfg.get("decay_steps", Progressive.decay_steps))
        if ws + ds <= total_steps:
            continue
        lam = float(n1_weight(jnp.asarray(float(total_steps)), r0=float(cfg.get("r0", 1.0)),
                              warmup_steps=ws, decay_steps=ds,
                              schedule=cfg.get("schedule", "linear")))
        return (f"config.model.norm: the progressive hand-over ends at step {ws + ds}, after the "
                f"run's {total_steps} steps (N1's weight {lam:.2f} at the end), but evaluation uses "
                f"N2 alone; set model.norm.decay_steps to at most {total_steps - ws} (the reference: 80% "
                f"of the run) or eval_mode='mixture'")
    return None


def n1_weight(step: jax.Array, *, r0: float, warmup_steps: int, decay_steps: int,
              schedule: str) -> jax.Array:
    """N1's weight at a global train step: 1 during warm-up (N1 alone), then lam (float32); 0
    from ``warmup_steps + decay_steps`` on (exactly, for both schedules)."""
    k = jnp.asarray(step, jnp.float32) - warmup_steps
    d = float(decay_steps)
    if schedule == "linear":
        lam = r0 * jnp.maximum(0.0, 1.0 - k / d)
    else:
        lam = r0 * (1.0 + jnp.cos(math.pi * jnp.minimum(k, d) / d)) / 2.0
    return jnp.where(k < 0, 1.0, lam).astype(jnp.float32)


class Progressive(nn.Module):
    """lam * N1 + (1 - lam) * N2 with lam from the global train step (module docstring).

    Options: n1, n2 (norm configs: a name or a mapping with 'name'), r0, warmup_steps,
    decay_steps (> 0), schedule ('linear' | 'cosine'), eval_mode ('n2' | 'mixture'), must_fold
    (True: fail at build unless evaluation is N2 alone and N2 folds into the next Dense), phase
    (set by the train loop, not by configs: the steps [first, end) the compiled step serves; end
    None: no end).
    N1's variables sit under ``n1``, N2's under ``n2``.
    """

    CONTEXT_FIELDS = ("ctx",)
    TAKES_STEP = True  # models pass the global train step: norm(x, train=..., step=...)
    # reparam's reason for keeping the slot (folds(opts) False)
    NOT_FOLDED = "evaluates the mixture with N1 (eval_mode='mixture') or its N2 does not fold"

    ctx: NormContext = NormContext(dim=1)
    n1: Any = _DEFAULT_N1
    n2: Any = _DEFAULT_N2
    r0: float = 1.0
    warmup_steps: int = 0
    decay_steps: int = 1000
    schedule: str = "linear"
    eval_mode: str = "n2"
    must_fold: bool = False
    phase: tuple[int, int | None] | None = None

    @classmethod
    def from_config(cls, opts: Mapping[str, Any], ctx: NormContext, name: str | None = None):
        from normvit_jax.norms import registry
        opts = dict(opts)
        for key, default in (("n1", _DEFAULT_N1), ("n2", _DEFAULT_N2)):
            cfg = _norm_cfg(opts.get(key, default))
            sub = cfg.get("name")
            if sub not in registry.REGISTRY:
                raise ValueError(f"norm 'progressive': {key}={sub!r} is not a registered norm; "
                                 f"known: {', '.join(registry.known_names())}")
            if sub == "progressive":
                raise ValueError(f"norm 'progressive': {key}='progressive' is not accepted "
                                 "(nested schedules); accepted: any other registered norm")
            opts[key] = cfg
        ds, ws = opts.get("decay_steps", 1000), opts.get("warmup_steps", 0)
        if isinstance(ds, bool) or not isinstance(ds, int) or ds <= 0:
            raise ValueError(f"norm 'progressive': decay_steps={ds!r} is not accepted; "
                             "accepted: a positive integer")
        if isinstance(ws, bool) or not isinstance(ws, int) or ws < 0:
            raise ValueError(f"norm 'progressive': warmup_steps={ws!r} is not accepted; "
                             "accepted: an integer >= 0")
        for key, allowed in (("schedule", SCHEDULES), ("eval_mode", EVAL_MODES)):
            if opts.get(key, getattr(cls, key)) not in allowed:
                raise ValueError(f"norm 'progressive': {key}={opts[key]!r} is not accepted; "
                                 f"accepted: {list(allowed)}")
        phase = opts.get("phase")
        if phase is not None and not (isinstance(phase, tuple) and len(phase) == 2
                                      and isinstance(phase[0], int) and phase[0] >= 0
                                      and (phase[1] is None or isinstance(phase[1], int))):
            raise ValueError(f"norm 'progressive': phase={phase!r} is not accepted; accepted: None "
                             "or (first, end) steps, end None for no end (set by train/phases.py)")
        r0 = opts.get("r0", 1.0)
        if not 0.0 <= float(r0) <= 1.0:
            raise ValueError(f"norm 'progressive': r0={r0!r} is not accepted; accepted: 0 <= r0 <= 1")
        module = cls(ctx=ctx, name=name, **opts)
        if opts.get("must_fold", False):
            if module.eval_mode != "n2":
                raise ValueError("norm 'progressive': must_fold=True needs eval_mode='n2' (a "
                                 f"mixture keeps N1's statistics), got eval_mode={module.eval_mode!r}")
            if not hasattr(registry.resolve(module.n2["name"]), "inference_affine"):
                raise ValueError(f"norm 'progressive': must_fold=True but n2={module.n2['name']!r} "
                                 "does not fold into the next Dense; accepted n2: a norm with "
                                 "inference_affine (repbn, batchnorm, learnable_scaler, unified, "
                                 "rescale)")
        return module

    @nn.nowrap
    def _sub(self, key: str, name: str | None = None) -> nn.Module:
        from normvit_jax.norms import registry
        c = self.ctx
        return registry.create(getattr(self, key), dim=c.dim, num_heads=c.num_heads, grid=c.grid,
                               num_prefix_tokens=c.num_prefix_tokens, slot=c.slot, name=name)

    def setup(self) -> None:
        self.norm1 = self._sub("n1", "n1")
        self.norm2 = self._sub("n2", "n2")

    @classmethod
    def phase_starts(cls, opts: Mapping[str, Any]) -> set[int]:
        """The steps at which this norm's train computation changes: the end of the warm-up (N1
        alone before it) and of the hand-over (N2 alone from it)."""
        ws = int(opts.get("warmup_steps", cls.warmup_steps))
        ds = int(opts.get("decay_steps", cls.decay_steps))
        return {ws, ws + ds} if ws else {ws + ds}

    def _train_part(self) -> str:
        """'n1', 'n2' or 'mix' where the phase decides it; 'any' where the step must."""
        if self.phase is None:
            return "any"
        first, end = self.phase
        if end is not None and end <= self.warmup_steps:
            return "n1"
        if first >= self.warmup_steps + self.decay_steps:
            return "n2"
        return "mix" if first >= self.warmup_steps else "any"

    def weight(self, step: jax.Array) -> jax.Array:
        """N1's weight at a global train step."""
        return n1_weight(step, r0=self.r0, warmup_steps=self.warmup_steps,
                         decay_steps=self.decay_steps, schedule=self.schedule)

    @classmethod
    def folds(cls, opts: Mapping[str, Any]) -> bool:
        """Whether the eval function of a config is N2's fixed affine (reparam reads it)."""
        from normvit_jax.norms import registry
        if opts.get("eval_mode", "n2") != "n2":
            return False
        return hasattr(registry.resolve(_norm_cfg(opts.get("n2", _DEFAULT_N2))["name"]),
                       "inference_affine")

    @nn.nowrap
    def inference_affine(self, params: Mapping[str, Any], stats: Mapping[str, Any]):
        """N2's eval affine (only with eval_mode 'n2' and a foldable N2)."""
        if not self.folds({"eval_mode": self.eval_mode, "n2": self.n2}):
            raise ValueError(f"norm 'progressive' with eval_mode={self.eval_mode!r}, "
                             f"n2={self.n2['name']!r} does not fold")
        sub = self._sub("n2")  # not wrapped (nn.nowrap): a free module, only its formula is used
        return sub.inference_affine(params.get("n2", {}), stats.get("n2", {}))

    def _token_mix(self, w: jax.Array) -> TokenMix | None:
        """N1 for N2's one-pass hand-over (norms/token_channel.py) where N1 standardises each
        token (LayerNorm, z-score) and N2 takes it (BatchNorm, RepBN); else None (two calls)."""
        ddof = getattr(type(self.norm1), "TOKEN_DDOF", None)
        if ddof is None or not getattr(type(self.norm2), "TAKES_TOKEN_MIX", False):
            return None
        p = self.norm1.variables.get("params", {})
        return TokenMix(w, p.get("scale"), p.get("bias"), self.norm1.epsilon, ddof)

    def __call__(self, x: jax.Array, train: bool = False,
                 step: jax.Array | None = None) -> jax.Array:
        if self.is_initializing():  # create both norms' variables whatever the mode
            self.norm1(x, train=False)
            return self.norm2(x, train=False)
        if not train and self.eval_mode == "n2":
            return self.norm2(x, train=False)
        if step is None:
            raise ValueError("norm 'progressive' needs the global train step: call the model as "
                             "model.apply(..., step=state.step) (training, or eval_mode='mixture')")
        part = self._train_part() if train else "any"
        if part in ("n1", "n2"):  # the phase's promise: the weight is constant (1 or 0)
            self.sow("schedule", "n1_weight", jnp.float32(part == "n1"))
            norm = self.norm1 if part == "n1" else self.norm2
            return norm(x, train=True).astype(jnp.float32).astype(x.dtype)
        w = self.weight(step)
        if not train:
            return (w * self.norm1(x, train=False).astype(jnp.float32) + (1.0 - w)
                    * self.norm2(x, train=False).astype(jnp.float32)).astype(x.dtype)
        self.sow("schedule", "n1_weight", w)
        if self._token_mix(w) is not None:  # N1 and N2 in one pass
            mix = lambda m, x: m.norm2(x, train=True, token_mix=m._token_mix(w)).astype(jnp.float32)
        else:
            mix = lambda m, x: (w * m.norm1(x, train=True).astype(jnp.float32)
                                + (1.0 - w) * m.norm2(x, train=True).astype(jnp.float32))
        if self.warmup_steps == 0 or part == "mix":  # no branch in the compiled step
            return mix(self, x).astype(x.dtype)
        # A data-dependent branch: on GPU each one makes the host read its predicate.
        only1 = lambda m, x: m.norm1(x, train=True).astype(jnp.float32)
        warm = jnp.asarray(step) < self.warmup_steps
        return nn.cond(warm, only1, mix, self, x).astype(x.dtype)
