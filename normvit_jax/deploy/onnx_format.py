"""ONNX through ``jax2onnx`` (the serving function's jaxpr, op by op, into ONNX opset 23; no
hand-written graph). The class names and the metadata are also ``metadata_props``
(``classes``, ``normvit_jax.deploy``).

Why jax2onnx (docs/deploy.md): jax2tf no longer writes plain TF ops (only ``XlaCallModule``,
which tf2onnx cannot convert), so the SavedModel route to ONNX is closed; jax2onnx converts
the jaxpr directly.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import re
from typing import Any, Callable

from normvit_jax.deploy import bundle as bundle_lib
from normvit_jax.deploy.errors import UnsupportedOpError, require

OPSET = 23


@functools.lru_cache(maxsize=None)
def _jax2onnx():
    """jax2onnx with only its jax and flax.linen plugins loaded. Its first conversion imports
    every plugin, and the equinox/dm_pix examples among them compile ~70 XLA programs at import
    (about 40 s on a 2-core machine); these two trees are all a linen model needs (7 s)."""
    j2o = require("jax2onnx", "the onnx format")
    require("onnx", "the onnx format")
    from pathlib import Path
    try:
        from jax2onnx import plugins
        from jax2onnx.plugins import plugin_system as ps
        if not ps._already_imported_plugins:
            root = Path(plugins.__file__).parent
            for sub in ("jax", "flax/linen"):
                ps._import_tree(root / sub, "jax2onnx.plugins." + sub.replace("/", "."))
            ps._already_imported_plugins = True
    except (ImportError, AttributeError):  # another jax2onnx layout: it imports them all itself
        pass
    return j2o


_PRIMITIVE = re.compile(r"primitive '([^']+)'")


def to_onnx(fn: Callable, specs: list, **kwargs: Any) -> Any:
    """``jax2onnx.to_onnx`` with a primitive it has no rule for as UnsupportedOpError."""
    j2o = _jax2onnx()
    # onnx_ir warns once per shape constant whose value_info (optional metadata) it leaves out:
    # ~100 lines of "value type ... is not known" per export that change nothing in the graph
    serde = logging.getLogger("onnx_ir.serde")
    level = serde.level
    serde.setLevel(logging.ERROR)
    try:
        return j2o.to_onnx(fn, specs, opset=OPSET, **kwargs)
    except NotImplementedError as e:
        text = " ".join(str(e).split())
        m = _PRIMITIVE.search(text)
        raise UnsupportedOpError(m.group(1) if m else text[:120], "onnx", text[:200]) from None
    finally:
        serde.setLevel(level)


def convert(b: bundle_lib.Bundle, batch: int | None, meta: dict | None = None) -> Any:
    """The ``onnx.ModelProto`` of the serving function. Attention is traced as explicit
    transposes and batched matmuls (``layers.matmul_attention``): jax2onnx keeps an einsum as
    ONNX ``Einsum``, which ONNX Runtime ran 2.5x slower than the ``MatMul``s of the same
    products (docs/deploy.md, "Speed")."""
    from normvit_jax.deploy import stablehlo_format
    from normvit_jax.models import layers
    with layers.matmul_attention():
        model = to_onnx(bundle_lib.serving_fn(b), [stablehlo_format.input_spec(b, batch)],
                        model_name="normvit_jax", input_names=[bundle_lib.INPUT],
                        output_names=sorted(bundle_lib.OUTPUTS))  # a dict: in key order
    if meta is not None:
        for key, value in (("classes", json.dumps(list(b.class_names))),
                           ("normvit_jax.deploy", json.dumps(meta))):
            prop = model.metadata_props.add()
            prop.key, prop.value = key, value
    return model


def write(b: bundle_lib.Bundle, out: str, batch: int | None, meta: dict) -> None:
    model = convert(b, batch, meta)
    tmp = out + ".tmp"
    with open(tmp, "wb") as f:
        f.write(model.SerializeToString())
    os.replace(tmp, out)
