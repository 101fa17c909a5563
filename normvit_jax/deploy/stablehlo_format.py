"""StableHLO through ``jax.export``: the serialized ``Exported`` (weights inside), loaded back
by ``jax.export.deserialize(bytes).call(image)`` in any JAX of a compatible version, no
model code needed."""
from __future__ import annotations

import os

import numpy as np

from normvit_jax.deploy import bundle as bundle_lib
from normvit_jax.deploy.errors import UnsupportedOpError


def input_spec(b: bundle_lib.Bundle, batch: int | None):
    import jax
    n = jax.export.symbolic_shape("N")[0] if batch is None else batch
    return jax.ShapeDtypeStruct((n, b.image_size, b.image_size, 3), np.uint8)


def exported(b: bundle_lib.Bundle, batch: int | None, platforms: tuple[str, ...] = ("cpu", "cuda")):
    """The ``jax.export.Exported`` of the serving function, lowered for ``platforms``."""
    import jax
    try:
        return jax.export.export(jax.jit(bundle_lib.serving_fn(b)), platforms=platforms)(
            input_spec(b, batch))
    except NotImplementedError as e:  # a primitive without a lowering for some platform
        raise UnsupportedOpError(str(e).split("\n")[0][:200], "stablehlo") from None


def write(b: bundle_lib.Bundle, out: str, batch: int | None, meta: dict) -> None:
    data = exported(b, batch).serialize()
    tmp = out + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, out)
