"""The norm modules of the methods' original PyTorch code, inside a timm ViT state dict, renamed to
this project's norm parameters (``timm_layout.canonicalize`` calls ``rename`` first).

A state dict does not name its norm's class: each original is recognised by its tensors' names in
one norm slot (``blocks.{i}.norm1``, ``norm2``, ``norm``, ``fc_norm``), and only those names are
changed; what the file's names already say (``weight``/``bias``, a BatchNorm's buffers) is left to
the timm renaming and the loader. Every rename carries a note for the loading report.

- SLAB ``RepBN`` (xinghaochen/SLAB classification/models/prepbn.py): ``alpha`` (1,) -> ``eta`` ();
  ``bn.*`` is a BatchNorm1d: this project's RepBN keeps it under ``bn`` too.
- SLAB ``LinearNorm``: ``norm1.*`` -> ``n1``, ``norm2.*`` -> ``n2`` (each renamed by these rules);
  its step buffers ``warm``, ``iter``, ``total_step`` (forwards counted per module) keep their
  names and are reported, never loaded: the schedule here is the config's (``schedule_note``).
- DyT ``DynamicTanh`` (jiachenzhu/DyT), Derf ``Dynamic_erf`` (zlab-princeton/Derf): ``alpha``,
  ``shift`` (1,) -> () (scalars here).
- DTN (wqshao126/DTN models/normkit/norms/dtn.py): ``mean_norm_weight`` -> ``mean_gate``,
  ``var_norm_weight`` -> ``var_gate``, ``pos_proj.weight`` (H, 3) -> ``pos_proj`` (3, H)
  transposed; ``pos_proj.bias`` (H,) is not loaded: a per-head constant cancels in the softmax
  over source tokens.
- LearnableScaler (nghiemtuan/LearnableScaler timm/layers/norm.py): ``a`` -> ``scale``,
  ``b`` -> ``bias``.
- PowerNorm (the DTN repository's us_powernorm.py): buffers ``running_phi``, ``ema_gz``
  (1, C, 1, 1) -> (C,) (the loader puts them into ``batch_stats``); ``iters`` (1,) -> ``t`` ().
"""
from __future__ import annotations

import re
from typing import Mapping

import numpy as np

from normvit_jax.models.google_layout import CheckpointError

# a norm slot of timm's ViT: blocks.{i}.norm1/norm2, the final norm, fc_norm (global_pool='avg')
_SLOT = re.compile(r"^(blocks\.\d+\.norm[12]|norm|fc_norm)\.(.+)$")
SCHEDULE_BUFFERS = ("warm", "iter", "total_step")  # SLAB LinearNorm's step counters
NOT_LOADED = SCHEDULE_BUFFERS + ("pos_proj_bias",)  # kept under these names, reported as dropped


def rename(sd: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The state dict with the originals' norm tensors renamed (timm's dotted names), and a note
    per renamed key saying what it was."""
    slots: dict[str, dict[str, np.ndarray]] = {}
    out: dict[str, np.ndarray] = {}
    for k, v in sd.items():
        m = _SLOT.match(k)
        if m:
            slots.setdefault(m.group(1), {})[m.group(2)] = v
        else:
            out[k] = v
    notes: dict[str, str] = {}
    for slot, local in slots.items():
        try:
            module = _module(local)
        except CheckpointError as e:  # a malformed original tensor: name it with its slot
            raise CheckpointError(f"{slot}.{e}") from None
        for k, (v, note) in module.items():
            out[f"{slot}.{k}"] = v
            if note:
                notes[f"{slot}.{k}"] = note
    return out, notes


def _kind(names: set[str], local: Mapping[str, np.ndarray]) -> str:
    """The original norm class one module's tensor names say ('' for none: LayerNorm, BatchNorm)."""
    if "alpha" in names and any(k.startswith("bn.") for k in names):
        return "SLAB RepBN"
    if "alpha" in names and np.shape(local["alpha"]) == (1,):
        return "Derf" if "shift" in names else "DyT"
    if names & {"mean_norm_weight", "var_norm_weight", "pos_proj.weight"}:
        return "DTN"
    if names == {"a", "b"}:
        return "LearnableScaler"
    if "running_phi" in names:
        return "PowerNorm"
    return ""


def _module(local: dict[str, np.ndarray]) -> dict[str, tuple[np.ndarray, str]]:
    """One norm module's tensors (names relative to it) -> {new name: (array, note)}."""
    names = set(local)
    if {"iter", "total_step"} <= names and any(k.startswith(("norm1.", "norm2.")) for k in names):
        return _linear_norm(local)
    kind = _kind(names, local)
    renamed: dict[str, tuple[np.ndarray, str]] = {}
    for k, v in local.items():
        if kind == "SLAB RepBN" and k == "alpha":
            renamed["eta"] = (_scalar(v, k, kind), "SLAB RepBN alpha -> eta")
        elif kind in ("DyT", "Derf") and k in ("alpha", "shift") and np.shape(v) == (1,):
            renamed[k] = (_scalar(v, k, kind), f"{kind} {k} (1,) -> ()")
        elif kind == "DTN" and k in ("mean_norm_weight", "var_norm_weight"):
            renamed[k.split("_")[0] + "_gate"] = (v, f"DTN {k} -> {k.split('_')[0]}_gate")
        elif kind == "DTN" and k == "pos_proj.weight" and np.ndim(v) == 2:
            renamed["pos_proj"] = (np.asarray(v).T, f"DTN pos_proj.weight {np.shape(v)} transposed")
        elif kind == "DTN" and k == "pos_proj.bias":
            renamed["pos_proj_bias"] = (v, "DTN pos_proj.bias: a per-head constant, it cancels in "
                                           "the softmax over source tokens")
        elif kind == "LearnableScaler":
            renamed["scale" if k == "a" else "bias"] = (v, f"LearnableScaler {k} -> "
                                                           f"{'scale' if k == 'a' else 'bias'}")
        elif kind == "PowerNorm" and k in ("running_phi", "ema_gz") and np.ndim(v) == 4:
            renamed[k] = (np.asarray(v).reshape(-1), f"PowerNorm {k} {np.shape(v)} -> (C,)")
        elif kind == "PowerNorm" and k == "iters":
            renamed["t"] = (_scalar(v, k, kind).astype(np.float32), "PowerNorm iters -> t")
        elif kind and k in ("weight", "bias"):  # the timm renaming makes weight 'scale'
            renamed[k] = (v, f"{kind} {k} -> {'scale' if k == 'weight' else 'bias'}")
        else:
            renamed[k] = (v, "")
    return renamed


def _linear_norm(local: dict[str, np.ndarray]) -> dict[str, tuple[np.ndarray, str]]:
    out: dict[str, tuple[np.ndarray, str]] = {}
    for sub, new in (("norm1", "n1"), ("norm2", "n2")):
        inner = {k[len(sub) + 1:]: v for k, v in local.items() if k.startswith(sub + ".")}
        for k, (v, note) in _module(inner).items():
            out[f"{new}.{k}"] = (v, "; ".join(x for x in (f"SLAB LinearNorm {sub} -> {new}", note) if x))
    note = schedule_note(*(int(_scalar(local[b], b, "SLAB LinearNorm")) if b in local else 0
                           for b in SCHEDULE_BUFFERS))
    for k, v in local.items():
        if not k.startswith(("norm1.", "norm2.")):
            out[k] = (v, note if k == "iter" else "SLAB LinearNorm step counter (see iter)"
                      if k in SCHEDULE_BUFFERS else "")
    return out


def schedule_note(warm: int, iters: int, total: int) -> str:
    """What SLAB LinearNorm's counters mean for this project's ``progressive`` norm. The original's
    N1 weight is r0 * iter / total_step after ``warm`` N1-only forwards; ``progressive`` with
    r0' = r0 * iter / total_step, decay_steps = iter and warmup_steps = warm continues it step for
    step (its linear schedule: r0' * (1 - k / decay_steps))."""
    if total <= 0:
        return "SLAB LinearNorm step counter (total_step 0): not loaded"
    if iters <= 0 and warm <= 0:
        return ("SLAB LinearNorm step counter: the hand-over had ended (N2 alone in training and "
                "eval): model.norm=repbn is that model")
    frac = iters / total
    return (f"SLAB LinearNorm step counter: N1 weight r0 x {iters}/{total} = r0 x {frac:.6g}"
            f"{f' after {warm} N1-only forwards' if warm > 0 else ''}; not loaded (this run's "
            f"schedule starts at its step 0): to continue it, model.norm.r0={frac:.6g} (times the "
            f"original's r0 if not 1), decay_steps={iters}, warmup_steps={max(warm, 0)}")


def _scalar(v: np.ndarray, name: str, kind: str) -> np.ndarray:
    """The one finite number ``v`` holds, or a CheckpointError naming it (``name``: its key)."""
    a = np.asarray(v)
    if a.size != 1 or not np.isfinite(a).all():
        held = f"{a.size} values" if a.size != 1 else "NaN/Inf"
        raise CheckpointError(f"{name} {a.shape}: {kind}'s {name} is one finite number, the file "
                              f"holds {held}")
    return a.reshape(())
