"""Normalization layers for token sequences, chosen by name from a config.

Contract: ``create(cfg, dim=..., num_heads=..., grid=...)`` returns a ``flax.linen.Module``
called as ``norm(x, train=bool)`` on (B, T, C) tokens, returning the same shape and dtype.
Statistics are computed in float32. Affine parameters are named ``scale`` and ``bias`` wherever
they mean LayerNorm's gamma/beta, so LayerNorm-pretrained weights load into them.
Running state lives in the ``batch_stats`` collection and is read through ``stop_gradient`` in the
training forward. A norm whose custom backward updates statistics (PowerNorm, UN) returns the
increment of those statistics as their cotangent: the train step differentiates the loss with
respect to ``batch_stats`` too and adds that cotangent to the state after the forward's updates.
A norm class with ``TAKES_STEP = True`` (progressive) is called ``norm(x, train=..., step=...)``
with the global train step, which the model takes as ``apply(..., step=state.step)``.
"""
from normvit_jax.norms.registry import (DEFAULT, REGISTRY, NormContext, as_dict, create, known_names,
                                        name_of, resolve)

__all__ = ["DEFAULT", "REGISTRY", "NormContext", "as_dict", "create", "known_names", "name_of",
           "resolve"]
