"""Maps a config name to a normalization module class.

Adding a normalizer: write one file in this package with a ``flax.linen.Module`` subclass whose
options are its dataclass fields (``_common.accepted_options``), and add one line to ``_ENTRIES``
below. The registry checks the options and builds ``cls(name=name, **options)``; a norm that needs
to validate options or read the ``NormContext`` (width, heads, grid) defines a classmethod
``from_config(opts, ctx, name=None)`` instead, with ``ctx.norm`` its registry name for messages.
"""
from __future__ import annotations

import functools
import importlib
import logging
import types
from typing import Any, Mapping

import flax.linen as nn

from normvit_jax import config_ranges
from normvit_jax.norms._common import NormContext, accepted_options, check_options

# name -> "module:Class". Imported lazily so a broken optional norm never breaks the others.
_ENTRIES: dict[str, str] = {
    "layernorm": "normvit_jax.norms.layernorm:LayerNorm",
    "identity": "normvit_jax.norms.identity:Identity",
    "rmsnorm": "normvit_jax.norms.rmsnorm:RMSNorm",
    "scalenorm": "normvit_jax.norms.rmsnorm:ScaleNorm",
    "groupnorm": "normvit_jax.norms.groupnorm:GroupNorm",
    "instancenorm": "normvit_jax.norms.groupnorm:InstanceNorm",
    "batchnorm": "normvit_jax.norms.batchnorm:BatchNorm",
    "powernorm": "normvit_jax.norms.powernorm:PowerNorm",
    "unified": "normvit_jax.norms.unified:UnifiedNorm",
    "dtn": "normvit_jax.norms.dtn:DTN",
    "dtn_var": "normvit_jax.norms.dtn:DTNVar",
    "learnable_scaler": "normvit_jax.norms.learnable_scaler:LearnableScaler",
    "rescale": "normvit_jax.norms.rescale:Rescale",
    "repbn": "normvit_jax.norms.repbn:RepBN",
    "zscore": "normvit_jax.norms.feature:ZScore",
    "minmax": "normvit_jax.norms.feature:MinMax",
    "dyt": "normvit_jax.norms.pointwise:DyT",
    "derf": "normvit_jax.norms.pointwise:Derf",
    "progressive": "normvit_jax.norms.progressive:Progressive",
}
REGISTRY = _ENTRIES


# The norm of a slot no config names.
DEFAULT: Mapping[str, Any] = types.MappingProxyType({"name": "layernorm"})


def known_names() -> list[str]:
    return sorted(_ENTRIES)


def as_dict(cfg: Any) -> dict[str, Any]:
    """A norm config as a plain dict: a name, a mapping or ConfigDict; None means ``DEFAULT``."""
    if cfg is None:
        return dict(DEFAULT)
    if isinstance(cfg, str):
        return {"name": cfg}
    if hasattr(cfg, "to_dict"):
        return cfg.to_dict()
    if isinstance(cfg, Mapping):
        return dict(cfg)
    raise TypeError(f"norm config must be a name or a mapping with 'name', got {cfg!r}")


def name_of(cfg: Any) -> str:
    """The registry name a norm config selects (a mapping without 'name': ``DEFAULT``'s)."""
    return as_dict(cfg).get("name", DEFAULT["name"])


def resolve(name: str) -> type[nn.Module]:
    if name not in _ENTRIES:
        raise ValueError(
            f"Unknown norm name {name!r} (config key model.norm.name); known: {', '.join(known_names())}"
        )
    module_name, cls_name = _ENTRIES[name].split(":")
    return getattr(importlib.import_module(module_name), cls_name)


def checked_options(cfg: Any) -> tuple[str, type[nn.Module], dict[str, Any]]:
    """(name, class, options) of a norm config with its options checked as ``create`` checks
    them (unknown ones, ranges, None), without building it: ``main.py --mode=config`` refuses
    what training would."""
    opts = as_dict(cfg)
    if "name" not in opts:
        raise ValueError(f"norm config {opts!r} has no 'name'; known: {', '.join(known_names())}")
    norm_name = opts.pop("name")
    cls = resolve(norm_name)
    # `--config.model.norm.name=layernorm` on a config written for another norm leaves that norm's
    # options behind (a locked ConfigDict cannot drop keys): ignore options that belong to another
    # registered norm, and fail on anything nobody knows.
    unknown = set(opts) - accepted_options(cls)
    foreign = {k for k in unknown if any(k in _options_of(other)
                                         for other in _ENTRIES if other != norm_name)}
    if foreign:
        _warn_once(f"norm {norm_name!r} ignores options of other norms: {sorted(foreign)}")
        opts = {k: v for k, v in opts.items() if k not in foreign}
    check_options(norm_name, opts, cls)
    config_ranges.check_norm_options(norm_name, opts, cls)
    return norm_name, cls, opts


def create(cfg: Any, *, dim: int, num_heads: int = 1, grid: tuple[int, int] | None = None,
           num_prefix_tokens: int = 0, slot: str = "", name: str | None = None) -> nn.Module:
    """Builds the norm named by ``cfg['name']`` with the remaining keys as its options.

    Options a norm does not know raise a ValueError naming them and the accepted ones.
    """
    norm_name, cls, opts = checked_options(cfg)
    ctx = NormContext(dim=dim, num_heads=num_heads, grid=None if grid is None else tuple(grid),
                      num_prefix_tokens=num_prefix_tokens, slot=slot, norm=norm_name)
    if hasattr(cls, "from_config"):
        return cls.from_config(opts, ctx, name=name)
    return cls(name=name, **opts)


def _options_of(name: str) -> set[str]:
    """A registered norm's options; none for one that does not import (it breaks only itself)."""
    try:
        return accepted_options(resolve(name))
    except ImportError:
        return set()


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    logging.warning(message)
