"""One colour and one display name per method, shared by every plot."""
from __future__ import annotations

import functools
import re
import zlib
from typing import Any, Mapping, Sequence

from matplotlib import colormaps

from normvit_jax import models, norms
from normvit_jax.norms.progressive import Progressive

_TAB10 = colormaps["tab10"].colors
_TAB20 = colormaps["tab20"].colors
_DARK2 = colormaps["Dark2"].colors

# method -> (display name, colour). tab10 for the common methods, tab20's light shades after,
# Dark2 for issue 26's (RepBN, the progressive hand-overs, the feature and point-wise norms).
METHODS: dict[str, tuple[str, tuple[float, ...]]] = {
    "layernorm": ("LN", _TAB10[0]),
    "batchnorm": ("BN", _TAB10[1]),
    "dtn": ("DTN", _TAB10[2]),
    "unified": ("UN", _TAB10[3]),
    "learnable_scaler": ("LearnableScaler (no norm)", _TAB10[4]),
    "groupnorm": ("GN", _TAB10[5]),
    "instancenorm": ("IN", _TAB10[6]),
    "rescale": ("RescaleViT (no norm)", _TAB10[7]),
    "powernorm": ("PowerNorm", _TAB10[8]),
    "rmsnorm": ("RMSNorm", _TAB10[9]),
    "scalenorm": ("ScaleNorm", _TAB20[1]),
    "dpn": ("DPN", _TAB20[3]),
    "dtn_var": ("DTN-var", _TAB20[5]),
    "identity": ("no norm", _TAB20[15]),
    "repbn": ("RepBN", _DARK2[1]),
    "progressive:layernorm->repbn": ("LN->RepBN", _DARK2[2]),
    "progressive:zscore->repbn": ("zscore->RepBN", _DARK2[3]),
    "progressive:minmax->repbn": ("minmax->RepBN", _DARK2[0]),
    "zscore": ("zscore", _DARK2[4]),
    "minmax": ("minmax", _DARK2[6]),
    "dyt": ("DyT", _DARK2[5]),
    "derf": ("Derf", _DARK2[7]),
}
_SPARE = [_TAB20[i] for i in (7, 9, 11, 13, 17, 19)]


def _norm_key(cfg: Any) -> str:
    """A norm config's name; a progressive norm's as 'progressive:N1->N2'."""
    name = norms.name_of(cfg)
    if name == "progressive":
        opts = norms.as_dict(cfg)
        n1, n2 = (norms.name_of(opts.get(k, getattr(Progressive, k))) for k in ("n1", "n2"))
        name = f"progressive:{n1}->{n2}"
    return name


# Overrides that are part of a method's own recipe (configs/vit_dtn.py: LN in the last two
# blocks and as the final norm), not a variant of it: slot -> norm name.
RECIPE_OVERRIDES = {"dtn": {"last_2": "layernorm", "final": "layernorm"}}
# Model options that are part of a method's own recipe (configs/vit_rescale.py: RescaleViT scales
# the residual branches and has no final norm): norm name -> {option: the recipe's value}.
RECIPE_OPTIONS = {"rescale": {"residual_scaling": "rescale", "final_norm": False}}


def _override_key(slot: str, cfg: Any, base: Mapping[str, Any]) -> str | None:
    """'block_1:rmsnorm' (with the options that differ from the base norm's where the name is
    the same, 'final:layernorm(epsilon=0.001)'); None for an override that changes nothing or
    belongs to the base norm's recipe."""
    if RECIPE_OVERRIDES.get(norms.name_of(base), {}).get(slot) == norms.name_of(cfg):
        return None
    opts = {k: v for k, v in norms.as_dict(cfg).items() if k != "name"}
    same_name = norms.name_of(cfg) == norms.name_of(base)
    diff = {k: v for k, v in opts.items() if not same_name or base.get(k) != v}
    if same_name and not diff:
        return None
    args = "(" + ",".join(f"{k}={v}" for k, v in sorted(diff.items())) + ")" if diff else ""
    return f"{slot}:{_norm_key(cfg)}{args}"


def method_of(config: Mapping[str, Any]) -> str:
    """The method of a run: the norm of its blocks ('progressive:N1->N2' for a progressive
    hand-over, its schedule options not part of the key; 'dpn' for LN with a Dual PatchNorm
    stem), then every other model option that changes the normalization, each as '+part':
    per-slot overrides ('+block_1:rmsnorm', '+final:...'), the placement ('+post'), RescaleViT's
    residual scaling ('+rescale'), no final norm ('+no_final_norm') and a T2T stem norm
    ('+stem:...'). Runs that differ in normalization never share the key (ln and an LN run with
    one RMSNorm block were averaged as two LN seeds); runs that share it are split further by
    their other config keys (analysis/recipes.py) before they pool as one method's seeds."""
    model = models.spec_class(config["model"]).resolve_partial(config["model"])  # every key
    name = _norm_key(model["norm"])
    base = norms.as_dict(model["norm"])
    parts = [name]
    if model.get("patch_norm", "none") != "none":
        parts = ["dpn"] if name == "layernorm" else [name, "dpn"]
    for slot, cfg in sorted((model.get("norm_overrides") or {}).items()):
        key = _override_key(str(slot), cfg, base)
        if key:
            parts.append(key)
    recipe = RECIPE_OPTIONS.get(norms.name_of(model["norm"]), {})
    if model.get("norm_placement", "pre") != "pre":
        parts.append(str(model["norm_placement"]))
    scaling = model.get("residual_scaling", "none")
    if scaling != recipe.get("residual_scaling", "none"):
        parts.append(str(scaling) if scaling != "none" else "no_residual_scaling")
    final = model.get("final_norm", True)
    if final is not recipe.get("final_norm", True):
        parts.append("no_final_norm" if final is False else "final_norm")
    if model.get("stem_norm") is not None and norms.name_of(model["stem_norm"]) is not None \
            and _norm_key(model["stem_norm"]) != name:
        parts.append(f"stem:{_norm_key(model['stem_norm'])}")
    return "+".join(parts)


def _slot_label(slot: str) -> str:
    """'block_3' -> 'block 3'; 'blocks_<a>_<b>' covers a <= block < b (models/spec.py):
    'blocks_0_1' -> 'block 0', 'blocks_2_5' -> 'blocks 2-4'."""
    m = re.fullmatch(r"blocks?_(\d+)(?:_(\d+))?", slot)
    if m:
        last = None if m[2] is None else int(m[2]) - 1
        return (f"block {m[1]}" if last is None or last <= int(m[1])
                else f"blocks {m[1]}-{last}")
    return {"final": "final norm", "stem": "stem"}.get(slot, slot)


def _part_label(part: str) -> str:
    """The readable name of one '+part' of a method key."""
    fixed = {"dpn": "Dual PatchNorm", "post": "post-norm", "sandwich": "sandwich-norm",
             "rescale": "residual rescale", "no_final_norm": "no final norm",
             "no_residual_scaling": "no residual rescale", "final_norm": "a final norm"}
    if part in fixed:
        return fixed[part]
    slot, _, norm = part.partition(":")
    norm, paren, args = norm.partition("(")
    return f"{label(norm)}{'(' + args if paren else ''} {_slot_label(slot)}"


# Short names of recipe keys in labels (the others: their shortest unique dotted suffix).
SHORT_KEYS = {"optimizer.learning_rate": "lr"}


@functools.lru_cache(maxsize=None)
def short_key(key: str) -> str:
    """A config key as a label writes it: 'optimizer.learning_rate' -> 'lr', 'model.depth' ->
    'depth', 'data.name' -> 'data.name' (the shortest dotted suffix no other key of
    configs/default.py ends with)."""
    if key in SHORT_KEYS:
        return SHORT_KEYS[key]
    from normvit_jax.analysis import recipes  # pylint: disable=import-outside-toplevel
    keys = [k.split(".") for k in {*recipes.flat({}), key}]
    parts = key.split(".")
    for i in range(len(parts) - 1, 0, -1):
        if sum(k[-(len(parts) - i):] == parts[i:] for k in keys) == 1:
            return ".".join(parts[i:])
    return key


def _recipe_label(recipe: str) -> str:
    """'batch_size=32,optimizer.learning_rate=0.001' -> 'batch_size=32, lr=0.001'."""
    items = re.split(r",(?=[A-Za-z_][\w.]*=)", recipe)
    return ", ".join(f"{short_key(k)}={v}" for k, _, v in (i.partition("=") for i in items))


def label(method: str) -> str:
    """The display name: a listed method's, a progressive pair's from its two norms, a
    method key with '+parts' as the base's with the parts, e.g. 'LN (+RMSNorm block 1)', and one
    of several recipes of a method (analysis/recipes.py) with the keys that tell them apart,
    'LN [lr=0.001]'."""
    if method.endswith("]") and "[" in method:
        base, _, recipe = method[:-1].partition("[")
        return f"{label(base)} [{_recipe_label(recipe)}]"
    if method in METHODS:
        return METHODS[method][0]
    if "+" in method:
        base, *parts = method.split("+")
        return f"{label(base)} (+" + ", ".join(_part_label(p) for p in parts) + ")"
    if method.startswith("progressive:") and "->" in method:
        n1, n2 = method.split(":", 1)[1].split("->", 1)
        return f"{label(n1)}->{label(n2)}"
    return method


def color(method: str) -> tuple[float, ...]:
    """The fixed colour of a method (a recipe of one: the method's); unknown methods get a
    stable spare colour. ``palette``: the colours of a report's methods, each its own."""
    method = method.partition("[")[0]
    if method in METHODS:
        return METHODS[method][1]
    return _SPARE[zlib.crc32(method.encode()) % len(_SPARE)]


def palette(methods: Sequence[str]) -> dict[str, tuple[float, ...]]:
    """One distinct colour per method of a report: each its ``color`` where no method before it
    took that colour (the first of several recipes of LN stays LN's blue), the others the first
    free colour of tab20 and Dark2 that no method of METHODS has, then those of methods absent
    from the report (two recipes of a method, or two spare colours' hashes, were drawn in one
    colour)."""
    out: dict[str, tuple[float, ...]] = {}
    methods = list(dict.fromkeys(methods))
    for m in methods:
        if color(m) not in out.values():
            out[m] = color(m)
    fixed = [c for _, c in METHODS.values()]
    free = [c for c in dict.fromkeys((*_TAB20, *_DARK2, *_TAB10)) if c not in out.values()]
    free = [c for c in free if c not in fixed] + [c for c in free if c in fixed]
    for m in methods:
        if m not in out:
            out[m] = free.pop(0) if free else color(m)
    return {m: out[m] for m in methods}
