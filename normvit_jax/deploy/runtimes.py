"""Runs an artifact in its own runtime (ONNX Runtime, TensorFlow, JAX's ``jax.export``) without
the model code: what ``serve`` and ``benchmarks.deploy`` call. A fixed-batch artifact gets its
inputs padded to that batch (and the padding dropped from the outputs)."""
from __future__ import annotations

import functools
import os
from typing import Callable

import numpy as np

from normvit_jax.deploy.errors import DeployError, require

RUNTIMES = {"onnx": "onnxruntime", "savedmodel": "tensorflow", "stablehlo": "jax"}


def _onnx(path: str, threads: int, spin: bool = True) -> Callable:
    ort = require("onnxruntime", "the onnx format")
    opts = ort.SessionOptions()
    if not spin:  # idle threads sleep at once instead of busy-waiting for the next call
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    # ONNX Runtime's defaults, said: every graph optimization (it fuses the attention's scale
    # into its matmul, bias adds into Gemm, drops the Dropouts); intra-op threads = the cores
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if threads:
        opts.intra_op_num_threads = threads
    session = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]

    def run(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        out = dict(zip(names, session.run(names, {"image": x})))
        return out["probabilities"], out["logits"]
    return run


def _savedmodel(path: str, threads: int) -> Callable:
    tf = require("tensorflow", "the savedmodel format")
    try:
        tf.config.set_visible_devices([], "GPU")
        if threads:
            tf.config.threading.set_intra_op_parallelism_threads(threads)
    except RuntimeError:  # TF already initialised in this process: keep its settings
        pass
    fn = tf.saved_model.load(path).signatures["serving_default"]

    def run(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        out = fn(image=tf.constant(x))
        return out["probabilities"].numpy(), out["logits"].numpy()
    return run


def _stablehlo(path: str, threads: int) -> Callable:
    jax = require("jax", "the stablehlo format")
    with open(path, "rb") as f:
        exp = jax.export.deserialize(bytearray(f.read()))
    call = jax.jit(exp.call)

    def run(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        out = call(x)
        return np.asarray(out["probabilities"]), np.asarray(out["logits"])
    return run


def open_artifact(path: str, fmt: str, batch: int | None = None, threads: int = 0,
                  spin: bool = True) -> Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """``run(images uint8 (N, H, W, 3)) -> (probabilities, logits)`` of the artifact at ``path``
    (``batch``: its fixed batch size, from its metadata; ``threads``: intra-op threads, 0 the
    runtime's default). ``spin=False`` (ONNX Runtime): its threads do not busy-wait between
    calls, which a server with one model wants but two sessions called in turn on few cores do
    not (each one's spinning threads slow the other: benchmarks/deploy.py)."""
    if not os.path.exists(path):
        raise DeployError(f"--artifact={path} does not exist")
    loaders = {"onnx": functools.partial(_onnx, spin=spin), "savedmodel": _savedmodel,
               "stablehlo": _stablehlo}
    if fmt not in loaders:
        raise DeployError(f"{path}: format {fmt!r} is not one of {sorted(loaders)}")
    try:
        run = loaders[fmt](path, threads)
    except DeployError:
        raise
    except Exception as e:  # noqa: BLE001  (each runtime has its own errors for a damaged file)
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise DeployError(f"{path} cannot be loaded by {RUNTIMES[fmt]} ({type(e).__name__}: "
                          f"{first}); export it again") from None
    if batch is None:
        return run

    def padded(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        outs = []
        for lo in range(0, len(x), batch):
            part = x[lo:lo + batch]
            pad = batch - len(part)
            if pad:
                part = np.concatenate([part, np.zeros((pad,) + part.shape[1:], part.dtype)])
            p, l = run(part)
            outs.append((p[:batch - pad], l[:batch - pad]))
        return np.concatenate([o[0] for o in outs]), np.concatenate([o[1] for o in outs])
    return padded
