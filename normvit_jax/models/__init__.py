"""Models chosen by name from ``config.model``."""
from normvit_jax.models.vit import VARIANTS, ViT, create, resolve_model_config

__all__ = ["VARIANTS", "ViT", "create", "resolve_model_config"]
