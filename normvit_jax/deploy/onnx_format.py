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
from normvit_jax.deploy.errors import ConverterError, UnsupportedOpError, require

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


def converter_module(error: BaseException) -> str | None:
    """The jax2onnx module (a plugin's, e.g. ``jax2onnx.plugins.jax.numpy.pow``, where one is in
    the traceback) in which ``error`` was raised; None where it was raised in normvit_jax's own
    code or a user's (a file outside the installed packages and the standard library, called
    after jax2onnx's last frame: a bug there, not the converter's, stays a traceback) or
    outside jax2onnx."""
    import sysconfig
    import traceback
    frames = [f.filename.replace(os.sep, "/") for f in traceback.extract_tb(error.__traceback__)]
    ours = os.path.dirname(os.path.dirname(os.path.abspath(__file__))).replace(os.sep, "/") + "/"
    stdlib = sysconfig.get_paths()["stdlib"].replace(os.sep, "/") + "/"

    def user_code(f: str) -> bool:
        return f.startswith(ours) or not (f.startswith(stdlib) or f.startswith("<")
                                          or "/site-packages/" in f or "/dist-packages/" in f)

    inside = [i for i, f in enumerate(frames) if "/jax2onnx/" in f]
    if not inside or any(user_code(f) for f in frames[inside[-1] + 1:]):
        return None
    plugins = [frames[i] for i in inside if "/jax2onnx/plugins/" in frames[i]]
    path = (plugins or [frames[inside[-1]]])[-1]
    tail = path[path.rindex("/jax2onnx/") + 1:]
    return tail[:-3].replace("/", ".") if tail.endswith(".py") else tail


def to_onnx(fn: Callable, specs: list, **kwargs: Any) -> Any:
    """``jax2onnx.to_onnx`` with a primitive it has no rule for as UnsupportedOpError, and an
    exception raised inside jax2onnx (``TypeError: '_DimExpr' object cannot be interpreted as an
    integer`` from its pow plugin with a dynamic batch) as ConverterError: one line naming the
    plugin and the way out (exit 2); NORMVIT_TRACEBACK=1 prints the converter's traceback."""
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
    except Exception as e:  # noqa: BLE001  (a converter's own failure; anything else re-raised)
        where = converter_module(e)
        if where is None:
            raise
        dynamic = any(not isinstance(d, int) for spec in specs for d in spec.shape)
        raise ConverterError("onnx", where, e, dynamic) from e  # NORMVIT_TRACEBACK shows e's
    finally:
        serde.setLevel(level)


def convert(b: bundle_lib.Bundle, batch: int | None, meta: dict | None = None) -> Any:
    """The ``onnx.ModelProto`` of the serving function. Attention is traced as explicit
    transposes and batched matmuls (``layers.matmul_attention``): jax2onnx keeps an einsum as
    ONNX ``Einsum``, which ONNX Runtime ran 2.5x slower than the ``MatMul``s of the same
    products (docs/deploy.md, "Speed")."""
    from normvit_jax.deploy import stablehlo_format
    from normvit_jax.models import layers
    forward = bundle_lib.serving_fn(b)

    def outputs_in_order(image: Any) -> tuple:  # a dict would flatten in key order (logits
        out = forward(image)  # first); the graph's outputs are in OUTPUTS' order, as documented
        return tuple(out[name] for name in bundle_lib.OUTPUTS)
    with layers.matmul_attention():
        model = to_onnx(outputs_in_order, [stablehlo_format.input_spec(b, batch)],
                        model_name="normvit_jax", input_names=[bundle_lib.INPUT],
                        output_names=list(bundle_lib.OUTPUTS))
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
