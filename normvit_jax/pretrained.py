"""Loads Google ViT .npz checkpoints, and timm / PyTorch state dicts (.safetensors, .pth, .bin:
``state_dict`` reads them, ``models.timm_layout`` renames them to the same layout), into this
repository's ViT: reads the file safely, maps its layout (``models.google_layout``) onto the model's
parameters (position embeddings resampled, head reset, norms mapped by parameter name) and reports
what happened to every parameter.

Public API: ``load_npz``, ``init_from_npz``, ``init_from_checkpoint`` (also running statistics),
``format_report`` (and, from the layout module,
``CheckpointError``, ``resample_grid``). Export is ``normvit_jax.export.export_npz``.
Every mismatch raises ``CheckpointError`` naming the keys and shapes: never a silent partial load.
"""
from __future__ import annotations

import re
import zipfile
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import numpy as np
from etils import epath
from flax import traverse_util
from flax.core import frozen_dict

from normvit_jax import models, state_dict
from normvit_jax.models import hf_layout, original_norms, scan_convert, timm_layout
from normvit_jax.models.google_layout import (BLOCK, MODEL_ONLY, NORM_SLOTS, POSEMB,
                                              CheckpointError, Layout, canonicalize, check_family,
                                              dims, flat_heads, grid_of, resample_grid, slot_of,
                                              summary)
from normvit_jax.models.spec import FC_SLOT, ViTSpec
from normvit_jax.preflight import npz_problem

__all__ = ["CheckpointError", "Row", "format_report", "init_from_checkpoint", "init_from_npz", "load_npz",
           "resample_grid"]

HF_LN_EPS = 1e-12  # transformers' ViTConfig.layer_norm_eps
PYTORCH_NUMBERINGS = ("timm", "hf")  # Layout.numbering of the state dict layouts
RUNNING_STATS = ("running_mean", "running_var", "num_batches_tracked")  # torch BatchNorm buffers


class Row(NamedTuple):
    """One line of the loading report. action: loaded | resampled | reinit | init | dropped."""

    param: str      # model parameter (for 'dropped': the checkpoint key)
    action: str
    source: str     # checkpoint key it came from ('' if none)
    shape: tuple
    note: str = ""


# ---------------------------------------------------------------------------------------- reading

def _read_npz(path: str) -> tuple[dict[str, np.ndarray], int]:
    """All arrays of an .npz (local or gs://), bfloat16 ('|V2') widened to float32; and their count."""
    p = epath.Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint {path!r} does not exist")
    out, n_bf16 = {}, 0
    try:
        with p.open("rb") as f:
            # numpy takes any file that is neither zip nor .npy for a pickle: say what it is
            problem = npz_problem(f.read(16))
            if problem:
                raise CheckpointError(f"{path}: {problem}")
            f.seek(0)
            npz = np.load(f, allow_pickle=False)
            if not isinstance(npz, np.lib.npyio.NpzFile):
                raise CheckpointError(f"{path}: a single .npy array, not an .npz archive of parameters")
            with npz:
                for key in npz.files:
                    try:
                        a = npz[key]
                    except ValueError as e:
                        if "allow_pickle" not in str(e):
                            raise
                        raise CheckpointError(
                            f"{path}: array {key!r} holds Python objects (a pickle); refusing to "
                            "load it (files are read with allow_pickle=False)") from None
                    if a.dtype.kind == "V" and a.dtype.itemsize == 2:  # bfloat16 saved without ml_dtypes
                        a = (a.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
                        n_bf16 += 1
                    elif a.dtype.kind not in "fiub":
                        raise CheckpointError(f"{path}: array {key!r} has unsupported dtype {a.dtype}")
                    out[key] = a
    except CheckpointError:
        raise
    except ValueError as e:
        if "pickle" in str(e):
            raise CheckpointError(f"{path}: a pickle, not an .npz archive; refusing to load it "
                                  "(files are read with allow_pickle=False)") from None
        raise CheckpointError(f"{path}: not a readable .npz archive (truncated or corrupt download?): "
                              f"{e}") from e
    except (zipfile.BadZipFile, EOFError, OSError) as e:
        raise CheckpointError(f"{path}: not a readable .npz archive (truncated or corrupt download?): "
                              f"{type(e).__name__}: {e}") from e
    if not out:
        raise CheckpointError(f"{path}: the archive holds no arrays")
    return out, n_bf16


def load_npz(path: str) -> dict[str, np.ndarray]:
    """Flat name -> array of an .npz checkpoint, read with ``allow_pickle=False``; bfloat16 -> float32."""
    return _read_npz(path)[0]


# ------------------------------------------------------------------------------------------ loading

def _dtype(x: Any) -> np.dtype:
    return np.dtype(x.dtype) if hasattr(x, "dtype") else np.asarray(x).dtype  # no device->host copy


class _ParamLoader:
    """Fills the model's flat per-block parameters from checkpoint arrays (canonical names),
    recording a report row per parameter and every mismatch."""

    def __init__(self, tgt: dict[str, Any], src: dict[str, np.ndarray], layout: Layout,
                 spec: ViTSpec, stats: dict[str, Any] | None = None):
        self.tgt, self.src, self.layout, self.spec = tgt, src, layout, spec
        self.stats = stats  # the model's flat batch_stats; None: not asked to load them
        self.new_stats: dict[str, Any] = dict(stats or {})
        self.slots = NORM_SLOTS | layout.norm_slots  # timm's files add the top-level fc_norm
        self.new: dict[str, Any] = dict(tgt)
        self.rows: list[Row] = []
        self.errors: list[str] = []
        self.used: set[str] = set()
        self.notes = dict(layout.notes)  # renamed from an original's norm module: what it was
        # tensors an original holds that no parameter here takes (reported with their reason)
        self.drop_notes = {k: n for k, n in layout.notes.items()
                           if k.rsplit("/", 1)[-1] in original_norms.NOT_LOADED}

    def shape(self, k: str) -> tuple:
        return tuple(np.shape(self.tgt[k]))

    def put(self, k: str, value: np.ndarray, action: str, source: str, note: str = "") -> None:
        value = np.asarray(value)
        if value.dtype.kind in "iub" and _dtype(self.tgt[k]).kind == "f":
            # integer weights are quantized ones (their scales elsewhere) or not weights at all
            self.errors.append(f"dtype: {source} is {value.dtype}, the model's {_dtype(self.tgt[k])} "
                               "(quantized weights, or not a weight)")
        elif value.dtype.kind == "f" and not np.isfinite(value).all():
            self.errors.append(f"not finite: {source} holds {np.isnan(value).sum()} NaN and "
                               f"{np.isinf(value).sum()} Inf values")
        self.new[k] = np.asarray(value, dtype=_dtype(self.tgt[k]))
        self.rows.append(Row(k, action, source, self.shape(k), note))
        self.used.add(source)

    def init(self, k: str, note: str) -> None:
        self.rows.append(Row(k, "init", "", self.shape(k), note))

    def drop(self, k: str, note: str) -> None:
        self.rows.append(Row(k, "dropped", k, self.src[k].shape, note))
        self.used.add(k)

    def same(self, k: str, note: str = "") -> None:
        """Loads k from the same name, or records why not."""
        if k not in self.src:
            self.errors.append(f"missing in checkpoint: {k} (model {self.shape(k)})")
        elif self.src[k].shape != self.shape(k):
            self.errors.append(f"shape mismatch: {k} checkpoint {self.src[k].shape} vs model {self.shape(k)}")
            self.used.add(k)  # reported here: not also 'unexpected in checkpoint'
        else:
            self.put(k, self.src[k], "loaded", k, note)

    def head(self, num_classes: int, keep_pre_logits: bool | None, reset: bool = False) -> None:
        """pre_logits kept or dropped by config; the head zeroed unless it fits and saw the same
        features (a head of the same shape may be another dataset's classes: ``reset`` zeroes it)."""
        tgt, src = self.tgt, self.src
        if "head/kernel" not in tgt or "head/bias" not in tgt:
            raise CheckpointError("model parameters have no 'head/kernel'/'head/bias'")
        if self.shape("head/kernel")[-1] != num_classes:
            raise CheckpointError(f"num_classes={num_classes} but the model's head is "
                                  f"{self.shape('head/kernel')}")
        pl_t = sorted(k for k in tgt if k.startswith("pre_logits/"))
        pl_s = sorted(k for k in src if k.startswith("pre_logits/"))
        if keep_pre_logits and not pl_t:
            r = src["pre_logits/kernel"].shape[-1] if "pre_logits/kernel" in src else "?"
            raise CheckpointError(f"init_keep_pre_logits=True but the model has no pre_logits: "
                                  f"set model.representation_size={r}, or "
                                  "init_keep_pre_logits=False")
        if keep_pre_logits and not pl_s:
            raise CheckpointError("init_keep_pre_logits=True but the checkpoint has no pre_logits: "
                                  "set init_keep_pre_logits=False")
        load_pl = bool(pl_t and pl_s) and keep_pre_logits is not False
        for k in pl_t:
            if load_pl:
                self.same(k)
            else:
                self.init(k, "init_keep_pre_logits=False" if pl_s else "checkpoint has no pre_logits")
        for k in pl_s if not load_pl else []:
            self.drop(k, "pre_logits not kept (model.representation_size unset or "
                         "init_keep_pre_logits=False)")
        # the head saw the same features iff the pre_logits it read load too, or neither side has
        # them (a new pre_logits layer at init feeds the head other features)
        same_features = load_pl or not (pl_s or pl_t)
        keys = ("head/kernel", "head/bias")
        if not reset and same_features and all(k in src and src[k].shape == self.shape(k)
                                               for k in keys):
            for k in keys:
                self.put(k, src[k], "loaded", k, f"same shape {self.shape('head/kernel')} as the "
                         "model's: kept (config.init_reset_head=True zeroes it for other classes)")
            return
        if reset:
            why = "config.init_reset_head=True"
        elif "head/kernel" not in src:
            why = "checkpoint has no head"
        elif not same_features:
            why = "head input changed (pre_logits dropped or new)"
        else:
            why = f"head {src['head/kernel'].shape} -> {self.shape('head/kernel')} (class count or width)"
        for k in keys:
            self.new[k] = np.zeros(self.shape(k), _dtype(tgt[k]))
            self.rows.append(Row(k, "reinit", k if k in src else "", self.shape(k), f"zeros: {why}"))
            self.used.add(k)

    def posemb_and_cls(self, image_size: Any, source_grid: Sequence[int] | None) -> None:
        """Class slots are decided by the model config and the layout, never from shapes."""
        spec, src, layout = self.spec, self.src, self.layout
        has_slot = spec.uses_cls and not spec.cls_token_at_block and spec.posemb == "learn"
        pe = src.get(POSEMB)
        if POSEMB in self.tgt:
            ts = self.shape(POSEMB)
            grid_t = None
            if image_size is not None:
                hw = (image_size, image_size) if np.ndim(image_size) == 0 else tuple(image_size)
                grid_t = (hw[0] // spec.patch_size, hw[1] // spec.patch_size)
            if pe is None:
                self.errors.append(f"missing in checkpoint: position embedding (model {POSEMB} {ts}); a "
                                   "checkpoint trained without one needs model.posemb='sincos2d' or 'none'")
            elif pe.ndim != 3 or pe.shape[2] != ts[2]:
                self.errors.append(f"shape mismatch: {POSEMB} checkpoint {pe.shape} vs model {ts}")
                self.used.add(POSEMB)  # reported here: not also 'unexpected in checkpoint'
            else:
                try:
                    gt = grid_of(ts[1] - int(has_slot), grid_t, f"model {POSEMB} {ts}")
                    gs = grid_of(pe.shape[1] - int(layout.class_slot), source_grid,
                                 f"checkpoint {layout.posemb_key} {pe.shape}",
                                 slots=int(layout.class_slot))
                except CheckpointError as e:
                    self.errors.append(str(e))
                    self.used.add(POSEMB)
                else:
                    grid = pe[0, int(layout.class_slot):].reshape(gs[0], gs[1], -1)
                    notes = []
                    if gs != gt:
                        grid = resample_grid(grid, gt)
                        notes.append(f"grid {gs[0]}x{gs[1]} -> {gt[0]}x{gt[1]} bilinear")
                    parts = [grid.reshape(1, gt[0] * gt[1], -1)]
                    if has_slot:  # big_vision adds no posemb to its class token: a zero slot is exact
                        parts.insert(0, pe[:, :1] if layout.class_slot else np.zeros_like(pe[:, :1]))
                        notes.append("class slot kept" if layout.class_slot
                                     else "class slot = 0 (none in checkpoint)")
                    self.put(POSEMB, np.concatenate(parts, 1), "resampled" if gs != gt else "loaded",
                             POSEMB, "; ".join(notes))
        elif pe is not None:
            self.drop(POSEMB, f"model.posemb={spec.posemb!r} has no learned table")
        if "cls" in self.tgt:
            if "cls" not in src:
                gap = "gap_fc_norm" if spec.fc_norm else "gap"
                self.errors.append(f"missing in checkpoint: cls (model {self.shape('cls')}); the checkpoint "
                                   f"has no class token (trained with GAP): set model.classifier='{gap}'")
            elif (layout.class_slot and pe is not None and not has_slot
                  and src["cls"].shape == self.shape("cls")):
                # The model adds no posemb to its class token: fold the checkpoint's slot into it.
                self.put("cls", src["cls"] + pe[:, :1], "loaded", "cls", "+ posemb class slot folded in")
            else:
                self.same("cls")
        elif "cls" in src:
            fits = file_classifier(src) == "token_gap_fc_norm" and spec.fc_norm
            # timm's global_pool='avg' with a class token: dropping it changes the function.
            self.drop("cls", f"model.classifier={spec.classifier!r}" + (
                ": a fine-tune start; model.classifier='token_gap_fc_norm' keeps the class token "
                "and loads the file's function" if fits else ""))

    def qkv_bias_hint(self) -> None:
        """A file saved without q/k/v biases (timm's qkv_bias=False) into a model with them: the
        first error names the config key, not only the missing biases."""
        missing = [e for e in self.errors if re.match(
            r"missing in checkpoint: .*MultiHeadDotProductAttention_1/(query|key|value)/bias ", e)]
        if missing and self.spec.qkv_bias and not any(
                re.search(r"MultiHeadDotProductAttention_1/(query|key|value)/bias$", k) for k in self.src):
            self.errors.insert(0, "the checkpoint has no query/key/value biases: set "
                                  "model.qkv_bias=False")

    def classifier_hint(self) -> None:
        """The file's final norm is in the other slot (timm's 'norm' vs 'fc_norm'): the first
        error names the classifier that reads it."""
        want = file_classifier(self.src)
        mine = FC_SLOT if self.spec.fc_norm else "Transformer/encoder_norm"
        if (self.errors and want and self.spec.final_norm
                and not any(k.startswith(mine + "/") for k in self.src)):
            where = "fc_norm (timm's global_pool='avg')" if want.endswith("fc_norm") else "encoder_norm"
            self.errors.insert(0, f"the checkpoint's final norm is {where}: set "
                                  f"model.classifier='{want}'")

    def handover(self) -> None:
        """A file slot holding a progressive hand-over's N1 and N2 (SLAB's LinearNorm, an export of
        a ``progressive`` run) read by a model slot with another norm: N2's tensors take the slot's
        names, the function the hand-over evaluates (N2 alone, at any step); N1's are dropped."""
        slots = {sl[0] for sl in map(lambda k: slot_of(k, self.slots), self.src) if sl}
        for s in sorted(slots):
            if (not any(k.startswith(s + "/n2/") for k in self.src)
                    or not any(t.startswith(s + "/") for t in self.tgt)
                    or self.spec.slot_norm_name(s) == "progressive"):
                continue
            for k in [k for k in self.src if k.startswith(s + "/n2/")]:
                new = s + k[len(s) + 3:]
                self.src[new] = self.src.pop(k)
                self.notes[new] = "; ".join(x for x in (self.notes.pop(k, ""), "N2 of the "
                                                        "hand-over (what it evaluates)") if x)
            for k in self.src:
                if k.startswith(s + "/n1/"):
                    self.drop_notes[k] = "N1 of the hand-over: its eval is N2 alone"

    def body(self) -> None:
        """Same layer -> same tensor; inside norm slots, by parameter name (scale/bias = LN's)."""
        done = {r.param for r in self.rows if r.action != "dropped"}
        done |= {POSEMB, "cls"} | {k for k in self.tgt if k.startswith(("head/", "pre_logits/"))}
        for k in self.tgt:
            if k in done:
                continue
            slot = slot_of(k, self.slots)
            fits = k in self.src and self.src[k].shape == self.shape(k)
            if slot is None:
                if k.split("/")[-1] in MODEL_ONLY:
                    if fits:  # a file this repository exported (normvit_jax.export)
                        self.put(k, self.src[k], "loaded", k, "same name in checkpoint")
                    else:
                        self.init(k, "no counterpart in Google checkpoints")
                elif k in self.src and self.src[k].shape != self.shape(k) and flat_heads(
                        k, self.src[k], self.shape(k)):
                    self.put(k, self.src[k].reshape(self.shape(k)), "loaded", k,
                             f"reshaped {self.src[k].shape} -> {self.shape(k)}")
                else:
                    self.same(k)
                continue
            s, rest = slot
            norm = self.spec.slot_norm_name(s)
            note = self.notes.get(k)  # renamed from an original's norm module
            if rest in ("scale", "bias") and fits:
                self.put(k, self.src[k], "loaded", k, note or (
                         "" if norm == "layernorm" else f"LN {rest} -> {norm} {rest}"))
            elif fits:  # not in Google's files: an export, or an original's renamed tensor
                self.put(k, self.src[k], "loaded", k,
                         f"{norm} {rest}: {note or 'same name in checkpoint'}")
            elif norm == "layernorm" and s.split("/")[-1] in self.layout.norm_slots:
                self.same(k)  # a LayerNorm slot the layout's files have: strict
            elif k in self.src:
                self.init(k, f"{norm} {rest}: shape {self.shape(k)} != checkpoint {self.src[k].shape}")
            elif any(x.startswith(s + "/") for x in self.src):
                self.init(k, f"{norm} parameter with no LayerNorm counterpart")
            else:
                self.init(k, "norm slot not in checkpoint")

    def running_stats(self) -> None:
        """torch BatchNorm buffers (timm names, renamed into their slot) -> the model's batch_stats
        of the same slot and path: running_mean -> mean, running_var -> var (what eval reads in
        both); other buffers under the model's statistic's own name and shape load as they are
        (PowerNorm's running_phi, ema_gz, t); the model's statistics the file lacks stay at init,
        reported. Google's files hold none: their report stays as it was."""
        if self.stats is None or self.layout.numbering not in PYTORCH_NUMBERINGS:
            return
        for k in sorted(self.src):
            slot = slot_of(k, self.slots)
            leaf = k.rsplit("/", 1)[-1]
            if slot is None or k in self.drop_notes:
                continue
            if leaf in ("running_mean", "running_var"):
                t = k.rsplit("/", 1)[0] + "/" + ("mean" if leaf == "running_mean" else "var")
            elif k in self.stats:
                t = k
            else:
                continue
            if t in self.stats and np.shape(self.stats[t]) == self.src[k].shape:
                self.new_stats[t] = np.asarray(self.src[k], _dtype(self.stats[t]))
                note = "; ".join(x for x in (leaf, self.notes.get(k, "")) if x)
                self.rows.append(Row("batch_stats/" + t, "loaded", k, self.src[k].shape, note))
                self.used.add(k)
        loaded = {r.param for r in self.rows}
        for t in self.stats:
            if "batch_stats/" + t not in loaded:
                self.rows.append(Row("batch_stats/" + t, "init", "", tuple(np.shape(self.stats[t])),
                                     "running statistic not in checkpoint"))

    def leftovers(self) -> None:
        """Checkpoint keys nothing consumed: LN params of a slot whose norm lacks them are dropped."""
        for k in sorted(set(self.src) - self.used):
            slot, m = slot_of(k, self.slots), BLOCK.match(k)
            if (slot is None or slot[0].split("/")[-1] not in self.layout.norm_slots
                    or (m and int(m.group(1)) >= self.spec.depth)):
                self.errors.append(f"unexpected in checkpoint: {k} {self.src[k].shape}")
                continue
            norm = self.spec.slot_norm_name(slot[0])
            if k in self.drop_notes:
                self.drop(k, self.drop_notes[k])
            elif slot[1].rsplit("/", 1)[-1] in RUNNING_STATS:  # torch BatchNorm buffers nothing took
                self.drop(k, "a step counter, not used" if k.endswith("num_batches_tracked") else
                          f"{norm} keeps no such running statistic" if self.stats is not None else
                          "running statistics are not loaded (batch_stats not given)")
            elif slot[0] in ("Transformer/encoder_norm", FC_SLOT) and not self.spec.final_norm:
                self.drop(k, "model.final_norm=False")
            else:
                why = (f"{norm} '{slot[1]}' has another shape" if k in self.tgt else
                       f"{norm} has no '{slot[1]}'" if any(x.startswith(slot[0] + "/")
                                                          for x in self.tgt) else
                       f"{norm} has no parameters")
                self.drop(k, why + (f" ({self.notes[k]})" if k in self.notes else ""))


def init_from_npz(params: Any, path: str, model: Any, num_classes: int, *,
                  keep_pre_logits: bool | None = None,
                  image_size: int | Sequence[int] | None = None,
                  source_grid: Sequence[int] | None = None, normalize: str | None = None,
                  reset_head: bool = False,
                  log: Callable[[str], Any] | None = print) -> tuple[Any, list[Row]]:
    """Returns ``params`` (freshly initialised, same structure) with the checkpoint's weights in:
    ``init_from_checkpoint`` without running statistics (the file's are reported as dropped)."""
    new, _, rows = init_from_checkpoint(params, None, path, model, num_classes,
                                        keep_pre_logits=keep_pre_logits, image_size=image_size,
                                        source_grid=source_grid, normalize=normalize,
                                        reset_head=reset_head, log=log)
    return new, rows


def init_from_checkpoint(params: Any, batch_stats: Any, path: str, model: Any, num_classes: int, *,
                         keep_pre_logits: bool | None = None,
                         image_size: int | Sequence[int] | None = None,
                         source_grid: Sequence[int] | None = None, normalize: str | None = None,
                         reset_head: bool = False,
                         log: Callable[[str], Any] | None = print) -> tuple[Any, Any, list[Row]]:
    """Returns ``(params, batch_stats, rows)``: the model's freshly initialised trees (same
    structures) with the checkpoint's weights in. ``batch_stats`` (None: not loaded) take a timm
    file's BatchNorm ``running_mean``/``running_var`` where the model's slot keeps ``mean``/``var``
    at the same path (Google's files have none).

    model: the ``ViTSpec`` (or ``config.model``) of the model ``params`` belong to; a scanned
    model (``model.scan``) loads every layout a per-block one loads.

    keep_pre_logits: None follows the model (``representation_size`` set: load pre_logits; unset:
    drop them); False leaves the model's pre_logits at init; True requires them in both.
    image_size: the fine-tuning resolution (int or (h, w)); needed for non-square patch grids.
    source_grid: the checkpoint's (rows, cols) grid when it is not square.
    normalize: ``config.data.normalize`` of the inputs the model will see (None: not known); a
    timm/HF file read with another normalization than the one it was trained on gets a note.
    The head is zeroed unless the checkpoint's head has the same shape and saw the same features,
    or always with ``reset_head`` (``config.init_reset_head``).
    Raises CheckpointError listing every missing, unexpected or mis-shaped key.
    """
    spec = models.spec_of(model, num_classes)
    check_family(spec)
    frozen = isinstance(params, frozen_dict.FrozenDict)
    tree = frozen_dict.unfreeze(params) if frozen else params
    wrapped = set(tree) == {"params"}
    tree = scan_convert.unstack_blocks(tree["params"] if wrapped else tree)  # matched per block
    tgt = traverse_util.flatten_dict(tree, sep="/")
    stats = None
    if batch_stats is not None:
        stats = traverse_util.flatten_dict(scan_convert.unstack_blocks(
            frozen_dict.unfreeze(batch_stats)), sep="/")
    timm = state_dict.is_state_dict_path(path)
    if timm:  # .safetensors / .pth / .bin: timm's names, renamed to the layout below
        raw, read_note = state_dict.read(path)
    else:
        raw, n_bf16 = _read_npz(path)
        read_note = f"{n_bf16} bfloat16 arrays widened" if n_bf16 else ""
    try:
        src, layout = _canonicalize_state_dict(raw, source_grid) if timm else canonicalize(raw)
    except CheckpointError as e:
        hint = "" if timm else _other_format(raw)
        raise CheckpointError(f"cannot load init_from {path}: {e}{hint}") from None

    hf_config = hf_layout.read_config(path) if layout.numbering == "hf" else None
    problem = hf_config and hf_layout.config_problem(hf_config, spec)
    if problem:
        raise CheckpointError(f"cannot load init_from {path}: {problem}")
    m = _ParamLoader(tgt, src, layout, spec, stats)
    m.head(num_classes, keep_pre_logits, reset_head)
    m.posemb_and_cls(image_size, source_grid)
    m.handover()
    m.body()
    m.running_stats()
    m.leftovers()
    m.qkv_bias_hint()
    m.classifier_hint()

    header = (f"init_from {path}\n  layout: {layout.describe()}"
              + (f"; {read_note}" if read_note else "")
              + (f"; ignored {len(layout.ignored)} non-parameter keys" if layout.ignored else "")
              + f"\n  checkpoint: {summary(src)}\n  model:      {summary(tgt)}")
    if m.errors:
        # The first line says it all (what differs, the first arrays); the full list follows.
        m.errors = fold_errors(m.errors)
        a, b = dims(src), dims(tgt)
        diff = [f"{k} (checkpoint {a[k]}, model {b[k]})" for k in a
                if a[k] != b[k] and "?" not in (a[k], b[k])]
        first = ([f"the model config differs from the checkpoint in {', '.join(diff)}"] if diff else [])
        first += m.errors[:2]
        more = len(m.errors) - 2
        line = (f"cannot load init_from {path}: " + "; ".join(first)
                + (f" (and {more} more, below)" if more > 0 else ""))
        shown = m.errors[:40] + ([f"... and {len(m.errors) - 40} more"] if len(m.errors) > 40 else [])
        detail = header.split("\n", 1)[1]
        raise CheckpointError(line + "\n" + detail + ("\n  " + "\n  ".join(shown) if more > 0 else ""))
    exact = (hf_config or {}).get("hidden_act", "gelu") in hf_layout.EXACT_GELU
    if timm and spec.gelu_approximate and exact:
        header += ("\n  note: model uses tanh GELU; timm's and HF's ViT compute the exact (erf) form "
                   "(logits differ by ~5e-4 on random weights, up to ~4e-3 on trained ones); "
                   "--config.model.gelu_approximate=False reproduces it")
    elif not spec.gelu_approximate and not exact:
        header += (f"\n  note: model uses exact (erf) GELU; the checkpoint's config.json says hidden_act="
                   f"{hf_config['hidden_act']!r}, the tanh form; --config.model.gelu_approximate=True")
    elif not timm and not spec.gelu_approximate:
        header += ("\n  note: model uses exact (erf) GELU; Google checkpoints were trained with the tanh "
                   "form (logits differ by ~5e-4)")
    if timm and normalize is not None:
        header += normalize_note(path, normalize, layout.numbering == "hf")
    eps = {n.get("epsilon", 1e-6) for n in spec.slot_norms if n["name"] == "layernorm"}
    hf_eps = float((hf_config or {}).get("layer_norm_eps", HF_LN_EPS))
    if layout.numbering == "hf" and eps - {hf_eps}:
        header += (f"\n  note: HF's ViT LayerNorm uses eps {hf_eps:g} (layer_norm_eps), the model "
                   f"{', '.join(f'{e:g}' for e in sorted(eps))} (logits differ by up to ~8e-4); "
                   f"--config.model.norm.epsilon={hf_eps:g} reproduces it")
    order = {k: i for i, k in enumerate(tgt)}
    rows = sorted(m.rows, key=lambda r: len(order) + 1 if r.action == "dropped"
                  else order.get(r.param, len(order)))  # batch_stats after the parameters
    if log is not None:
        log(format_report(rows, header))
    out = traverse_util.unflatten_dict(m.new, sep="/")
    if spec.scan:
        out = scan_convert.to_layout(out, spec)
    out = {"params": out} if wrapped else out
    new_stats = batch_stats
    if stats:
        new_stats = scan_convert.to_layout(traverse_util.unflatten_dict(m.new_stats, sep="/"), spec)
        if isinstance(batch_stats, frozen_dict.FrozenDict):
            new_stats = frozen_dict.freeze(new_stats)
    return (frozen_dict.freeze(out) if frozen else out), new_stats, rows


IMAGENET_MEAN_STD = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))  # timm's IMAGENET_DEFAULT_*
HALF_MEAN_STD = ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))  # = minus_one_one: Google's ViTs and their ports


def normalize_note(path: str, normalize: str, hf: bool) -> str:
    """A report note (or '') when a timm/HF file is loaded for inputs normalized otherwise than
    it was trained on. An HF hub folder's preprocessor_config.json records its image_mean/std;
    a timm file records nothing: the note names timm's two conventions and where to check."""
    if hf:
        mean_std = hf_layout.read_image_mean_std(path)
        if mean_std is not None:
            want = next((name for name, ms in (("imagenet", IMAGENET_MEAN_STD),
                                               ("minus_one_one", HALF_MEAN_STD))
                         if np.allclose(mean_std, ms, atol=1e-3)), None)
            if want == normalize:
                return ""
            fix = (f"--config.data.normalize={want} reproduces its inputs" if want else
                   "--config.data.normalize=zscore with these statistics reproduces them")
            return (f"\n  note: inputs are data.normalize={normalize!r}; the file's "
                    f"preprocessor_config.json says image_mean {list(mean_std[0])}, image_std "
                    f"{list(mean_std[1])}: {fix}")
        if normalize == "imagenet":
            return ""
        return (f"\n  note: inputs are data.normalize={normalize!r}; HF's facebook/deit-* expect "
                "--config.data.normalize=imagenet, google/vit-* 'minus_one_one': check image_mean/"
                "image_std in the hub folder's preprocessor_config.json (wrong inputs cost accuracy "
                "silently)")
    if normalize == "imagenet":
        return ""
    return (f"\n  note: inputs are data.normalize={normalize!r}; timm's ViTs trained on ImageNet-1k "
            "(DeiT, the norm methods' originals) expect --config.data.normalize=imagenet, Google's "
            "ports (augreg, orig_in21k) expect 'minus_one_one': the file does not record it, check "
            "timm.create_model(NAME).pretrained_cfg['mean'] (wrong inputs cost accuracy silently)")


def _canonicalize_state_dict(raw: dict[str, np.ndarray], source_grid: Sequence[int] | None
                             ) -> tuple[dict[str, np.ndarray], Layout]:
    """A PyTorch state dict's layout, told by its key names: HF transformers' ViT or timm's."""
    if hf_layout.looks_like_hf(list(raw)):
        return hf_layout.canonicalize(raw, source_grid)
    return timm_layout.canonicalize(raw, source_grid)


def _other_format(raw: dict[str, np.ndarray]) -> str:
    """A hint naming the format of a file that is not one of Google's ViT layouts."""
    keys = list(raw)
    if hf_layout.looks_like_hf(keys):
        return ("; its keys are an HF transformers ViT state dict ('vit.embeddings...', "
                "'encoder.layer.0...'): an .npz is read as Google's layouts; save it as "
                ".safetensors to load it (docs/pretrained.md)")
    if timm_layout.looks_like_timm(keys):
        return ("; its keys are a timm / PyTorch state dict ('patch_embed.proj.weight', "
                "'blocks.0.norm1.weight'): an .npz is read as Google's vit_jax, AugReg or big_vision "
                "layout; save the state dict as .safetensors (or .pth) to load it as timm's "
                "(docs/pretrained.md)")
    return ""


def block_span(blocks: Sequence[int]) -> str:
    """Block indices as runs, '0..1,3..11': a gap (a block with another norm) is never covered."""
    runs: list[list[int]] = []
    for i in sorted(set(blocks)):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(f"{a}" if a == b else f"{a}..{b}" for a, b in runs)


def file_classifier(src: Mapping[str, Any]) -> str | None:
    """The ``model.classifier`` a file's pooling implies (vit_jax names): its final norm's slot
    and whether it has a class token; None without a final norm."""
    has = lambda slot: any(k.startswith(slot + "/") for k in src)  # noqa: E731
    cls = "cls" in src
    if has(FC_SLOT):
        return "token_gap_fc_norm" if cls else "gap_fc_norm"
    if has("Transformer/encoder_norm"):
        return "token" if cls else "gap"
    return None


def fold_errors(errors: Sequence[str]) -> list[str]:
    """Errors that differ only in the block index, one line each (a ViT-B of another width: 16
    lines, not 192)."""
    groups: dict[str, list[int]] = {}
    for e in errors:
        m = re.search(r"encoderblock_(\d+)/", e)
        key = re.sub(r"encoderblock_\d+/", "encoderblock_{i}/", e) if m else e
        groups.setdefault(key, []).extend([int(m.group(1))] if m else [])
    return [k.replace("{i}", block_span(v)) if v else k for k, v in groups.items()]


def format_report(rows: Sequence[Row], header: str = "") -> str:
    """A table of the rows; rows that differ only in the block index are folded into one line."""
    groups: dict[tuple, list[int]] = {}
    for r in rows:
        m = BLOCK.match(r.param)
        key = (BLOCK.sub("Transformer/encoderblock_{i}/", r.param), r.action,
               BLOCK.sub("Transformer/encoderblock_{i}/", r.source), r.shape, r.note)
        groups.setdefault(key, []).append(int(m.group(1)) if m else -1)
    lines = []
    for (param, action, source, shape, note), idx in groups.items():
        blocks = sorted(i for i in idx if i >= 0)
        if blocks:
            span = block_span(blocks)
            param = param.replace("{i}", span)
            source = source.replace("{i}", span)
        src_col = "" if source in ("", param) else f"<- {source}"
        lines.append((param, str(shape), action, " ".join(x for x in (src_col, note) if x)))
    w = [max([len(x[i]) for x in lines] + [5]) for i in range(3)]
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.action] = counts.get(r.action, 0) + 1
    table = [f"  {'param':<{w[0]}}  {'shape':<{w[1]}}  {'action':<{w[2]}}  note"]
    table += [f"  {a:<{w[0]}}  {b:<{w[1]}}  {c:<{w[2]}}  {d}".rstrip() for a, b, c, d in lines]
    summary = "  " + ", ".join(f"{n} {a}" for a, n in sorted(counts.items()))
    return "\n".join(([header] if header else []) + table + [summary])
