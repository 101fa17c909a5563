"""Models chosen by ``config.model.name``: a family is one module class whose ``spec_class``
resolves ``config.model`` (a new family: one file and one ``FAMILIES`` entry)."""
from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from normvit_jax.models.spec import VARIANTS, ViTSpec
from normvit_jax.models.t2t_vit import T2TViT, T2TViTSpec
from normvit_jax.models.vit import ViT

FAMILIES: dict[str, type[nn.Module]] = {"vit": ViT, "t2t_vit": T2TViT}


def spec_of(config: Any, num_classes: int | None = None, *, dtype: Any = None,
            remat: bool | None = None) -> Any:
    """The spec of a model: from a spec (returned as is but for the arguments given), from
    ``config.model``, or from a whole run config (its ``model``; ``num_classes`` is the caller's,
    e.g. the run's ``DataSpec.num_classes``: None gives a spec without a head's size).

    ``dtype`` (default float32) and ``remat`` (default False) are the run's: ``config.dtype`` and
    ``config.remat`` are not read here (analysis builds float32 models of bfloat16 runs)."""
    if any(isinstance(config, f.spec_class) for f in FAMILIES.values()):
        given = dict(num_classes=num_classes, dtype=dtype, remat=remat)
        changes = {k: v for k, v in given.items() if v is not None and v != getattr(config, k)}
        return dataclasses.replace(config, **changes) if changes else config
    if hasattr(config, "model") and hasattr(config, "data"):  # a whole run config
        config = config.model
    return spec_class(config).from_config(
        config, num_classes, dtype=jnp.float32 if dtype is None else dtype, remat=bool(remat))


def spec_class(model_config: Any) -> type:
    """The spec class of ``config.model``'s family (``name``; none given: 'vit')."""
    name = (model_config.get("name") if hasattr(model_config, "get") else None) or "vit"
    if name not in FAMILIES:
        raise ValueError(f"model.name={name!r} is not known; accepted: {sorted(FAMILIES)}")
    return FAMILIES[name].spec_class


def create(config: Any, num_classes: int | None = None, *, dtype: Any = None,
           remat: bool | None = None) -> nn.Module:
    """The model of a spec, ``config.model`` or run config (see ``spec_of``)."""
    spec = spec_of(config, num_classes, dtype=dtype, remat=remat)
    return FAMILIES[spec.family](spec)


__all__ = ["FAMILIES", "VARIANTS", "T2TViT", "T2TViTSpec", "ViT", "ViTSpec", "create", "spec_of"]
