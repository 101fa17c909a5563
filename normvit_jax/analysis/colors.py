"""One colour and one display name per method, shared by every plot."""
from __future__ import annotations

import zlib
from typing import Any, Mapping

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


def method_of(config: Mapping[str, Any]) -> str:
    """The method of a run: the norm of its blocks, 'progressive:N1->N2' for a progressive
    hand-over (its schedule options are not part of the key), or 'dpn' for LN with a Dual
    PatchNorm stem."""
    model = models.spec_class(config["model"]).resolve_partial(config["model"])  # every key
    name = norms.name_of(model["norm"])
    if name == "progressive":
        opts = norms.as_dict(model["norm"])
        n1, n2 = (norms.name_of(opts.get(k, getattr(Progressive, k))) for k in ("n1", "n2"))
        name = f"progressive:{n1}->{n2}"
    if model["patch_norm"] != "none":
        return "dpn" if name == "layernorm" else f"{name}+dpn"
    return name


def label(method: str) -> str:
    """The display name; a progressive pair not listed is named from its two norms."""
    if method not in METHODS and method.startswith("progressive:") and "->" in method:
        n1, n2 = method.split(":", 1)[1].split("->", 1)
        return f"{label(n1)}->{label(n2)}"
    return METHODS.get(method, (method, None))[0]


def color(method: str) -> tuple[float, ...]:
    """The fixed colour of a method; unknown methods get a stable spare colour."""
    if method in METHODS:
        return METHODS[method][1]
    return _SPARE[zlib.crc32(method.encode()) % len(_SPARE)]
