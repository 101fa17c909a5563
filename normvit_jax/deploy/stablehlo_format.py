"""StableHLO through ``jax.export``: the serialized ``Exported`` (weights inside), loaded back
by ``jax.export.deserialize(bytes).call(image)`` in any JAX of a compatible version, no
model code needed."""
from __future__ import annotations

import os
from typing import Any, Callable

import numpy as np

from normvit_jax.deploy import bundle as bundle_lib
from normvit_jax.deploy.errors import UnsupportedOpError


def input_spec(b: bundle_lib.Bundle, batch: int | None) -> Any:
    import jax
    n = jax.export.symbolic_shape("N")[0] if batch is None else batch
    return jax.ShapeDtypeStruct((n, b.image_size, b.image_size, 3), np.uint8)


PLATFORMS = ("cpu", "cuda")  # one artifact for both: jax picks the lowering at run time


def export(fn: Callable, spec: Any, fmt: str = "stablehlo") -> Any:
    """``jax.export.export`` of ``fn`` at ``spec``; what it cannot serialize (host callbacks,
    a primitive without a lowering) as UnsupportedOpError."""
    import jax
    try:
        return jax.export.export(jax.jit(fn), platforms=PLATFORMS)(spec)
    except NotImplementedError as e:
        raise UnsupportedOpError(" ".join(str(e).split())[:160], fmt) from None


def exported(b: bundle_lib.Bundle, batch: int | None) -> Any:
    """The ``jax.export.Exported`` of the serving function."""
    return export(bundle_lib.serving_fn(b), input_spec(b, batch))


def write(b: bundle_lib.Bundle, out: str, batch: int | None, meta: dict) -> None:
    data = exported(b, batch).serialize()
    tmp = out + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, out)
