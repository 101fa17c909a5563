"""TF SavedModel through ``jax2tf`` (native serialization: the StableHLO of the serving function
inside one ``XlaCallModule`` op, run by TensorFlow's XLA; TF Serving loads the same folder). The
weights are TF variables (``variables/``), the signature ``serving_default`` takes ``image`` and
returns ``probabilities`` and ``logits``; ``classes.json`` and ``deploy.json`` are assets."""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile

from normvit_jax.deploy import bundle as bundle_lib
from normvit_jax.deploy.errors import DynamicBatchError, UnsupportedOpError, require


def _tf():
    tf = require("tensorflow", "the savedmodel format")
    try:  # TF only runs the artifact here; never let it take an accelerator's memory
        tf.config.set_visible_devices([], "GPU")
    except RuntimeError:
        pass
    return tf


_UNREGISTERED = re.compile(r"unregistered operation '([^']+)'")
_WHERE = re.compile(r"([\w./-]+\.py:\d+):\d+: error")


def _check_tf_runs(tf: object, concrete: object, batch: int | None, size: int) -> None:
    """Runs the signature once in TensorFlow: its XlaCallModule deserializes the StableHLO only
    here, and a TF older than the JAX that wrote it refuses operations it does not know (JAX
    0.10 writes erf as a ``composite`` that TF 2.21 cannot read; JAX 0.11 checks a dynamic
    batch's size with a ``shape_assertion`` custom call in a form TF 2.21 cannot read)."""
    try:
        concrete(tf.zeros([batch or 1, size, size, 3], tf.uint8))
    except tf.errors.InvalidArgumentError as e:
        text = str(e)
        op, where = _UNREGISTERED.search(text), _WHERE.search(text)
        if op is None:
            raise
        if batch is None and "shape_assertion" in text:
            import jax
            raise DynamicBatchError(
                f"--format=savedmodel with a dynamic batch: TensorFlow {tf.__version__}'s "
                f"XlaCallModule cannot read the batch-size check ({op.group(1)!r}) that jax "
                f"{jax.__version__} writes for it; export a fixed batch (--batch=N), or use "
                "onnx or stablehlo") from None
        raise UnsupportedOpError(op.group(1), "savedmodel", (
            f"written at {where.group(1)}; " if where else "") + f"TensorFlow {tf.__version__}'s "
            "XlaCallModule cannot read it") from None


def write(b: bundle_lib.Bundle, out: str, batch: int | None, meta: dict) -> None:
    tf = _tf()
    import jax
    from jax.experimental import jax2tf
    poly = None if batch is None else f"({batch}, ...)"
    fn = jax2tf.convert(bundle_lib.serving_fn(b, with_variables=True), with_gradient=False,
                        polymorphic_shapes=[None, "(N, ...)" if batch is None else poly],
                        native_serialization_platforms=("cpu", "cuda"))
    module = tf.Module()
    module.variables_tree = jax.tree.map(lambda a: tf.Variable(a, trainable=False), b.variables)
    shape = [batch, b.image_size, b.image_size, 3]
    # The signature's batch is left open even with --batch: TensorFlow does not check a
    # signature's declared shape (one declared (3, ...) ran a batch of 1 into XlaCallModule,
    # whose error was 61 KB of MLIR), and a static shape makes any check in the graph a constant.
    spec = tf.TensorSpec([None] + shape[1:], tf.uint8, name=bundle_lib.INPUT)

    @tf.function(input_signature=[spec], autograph=False)
    def serve(image):
        if batch is not None:  # "Shape of tensor image [1,H,W,3] is not compatible with
            image = tf.ensure_shape(image, shape)  # expected shape [3,H,W,3]": a short error
        return fn(module.variables_tree, image)

    staging = tempfile.mkdtemp(prefix="assets-", dir=os.path.dirname(os.path.abspath(out)))
    try:
        for name, value in (("classes.json", list(b.class_names)), ("deploy.json", meta)):
            with open(os.path.join(staging, name), "w", encoding="utf-8") as f:
                json.dump(value, f, indent=2)
        module.classes = tf.saved_model.Asset(os.path.join(staging, "classes.json"))
        module.metadata = tf.saved_model.Asset(os.path.join(staging, "deploy.json"))
        try:  # only the signature is saved: a tracked tf.function would be traced (and the
            # model converted by jax2tf) a second time by tf.saved_model.save
            concrete = serve.get_concrete_function()
        except NotImplementedError as e:
            raise UnsupportedOpError(str(e).split("\n")[0][:200], "savedmodel") from None
        _check_tf_runs(tf, concrete, batch, b.image_size)
        tmp = out.rstrip("/") + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tf.saved_model.save(module, tmp, signatures={"serving_default": concrete})
        if os.path.isdir(out):
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
