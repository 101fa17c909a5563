"""The norms' own learned gates and magnitudes, read from a model's variables.

Per norm slot (path like 'encoderblock_0/LayerNorm_0', 'encoder_norm', 'embedding/patch_norm_pre'):
  DTN           lambda_var_h{i}, lambda_mean_h{i}: sigmoid of the per-head gate logits
                (1: LN statistics, 0: position-aware IN statistics)
  UN            skip_rate: outlier-filtered steps / training steps (state 'skips' / 't')
  any 'scale'   scale_abs_mean: mean |gamma| (LN-style affine, LearnableScaler's scaler, RepBN's
                'bn/scale')
  ScaleNorm     g_abs_mean: mean |g|
  DyT, DeRF     alpha: the learned input scale of tanh(alpha x) / erf(alpha x + shift);
                DeRF also shift
  RepBN         eta: the learned weight of the identity in BN(x) + eta x
Per block: rescale_s, RescaleViT's learnable residual-branch factor.
"""
from __future__ import annotations

import re
from typing import Any, Mapping

import numpy as np

from normvit_jax.models import scan_convert
from normvit_jax.models.spec import ALL_SLOTS

SLOT = re.compile("^(" + "|".join(sorted(ALL_SLOTS)) + ")$")


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _slot_gates(params: Mapping[str, Any], state: Mapping[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, name in (("var_gate", "lambda_var"), ("mean_gate", "lambda_mean")):
        if key in params:
            for h, v in enumerate(_sigmoid(np.asarray(params[key], np.float64))):
                out[f"{name}_h{h}"] = float(v)
    # RepBN keeps its BN's affine one level down ('bn/scale'): it was missing from the gates
    bn = params.get("bn")
    scale = params.get("scale", bn.get("scale") if isinstance(bn, Mapping) else None)
    if scale is not None:
        out["scale_abs_mean"] = float(np.mean(np.abs(scale)))
    if "g" in params:
        out["g_abs_mean"] = float(np.mean(np.abs(params["g"])))
    for key in ("alpha", "shift", "eta"):  # the pointwise norms' and RepBN's learned scalars
        if key in params and np.ndim(params[key]) == 0:
            out[key] = float(np.asarray(params[key]))
    if "skips" in state and "t" in state:
        out["skip_rate"] = float(np.asarray(state["skips"]) / max(float(np.asarray(state["t"])), 1.0))
    return out


def norm_gates(variables: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """slot path -> {gate name: value}; slots without gates are left out."""
    out: dict[str, dict[str, float]] = {}

    def walk(params: Mapping[str, Any], state: Mapping[str, Any], path: tuple[str, ...]) -> None:
        for key, value in params.items():
            if not isinstance(value, Mapping):
                if key == "rescale_s":
                    out.setdefault("/".join(path), {})["rescale_s"] = float(np.asarray(value))
                continue
            sub_state = state.get(key, {}) if isinstance(state, Mapping) else {}
            where = path + (key,) if key != "Transformer" else path
            if SLOT.match(key):
                gates = _slot_gates(value, sub_state)
                if gates:
                    out["/".join(where)] = gates
            else:
                walk(value, sub_state, where)

    walk(scan_convert.unstack_blocks(variables["params"]),
         scan_convert.unstack_blocks(variables.get("batch_stats", {})), ())
    return out


def flat(gates: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """'slot/gate' -> value."""
    return {f"{slot}/{name}": v for slot, d in gates.items() for name, v in d.items()}
