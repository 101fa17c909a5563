"""Runs exported artifacts the way a user without this project would (docs/deploy.md), in its own
process: ``python tests/artifact_runner.py JOBS.json``. JOBS: {"images": [PNG files], "out": NPZ,
"artifacts": {"onnx" | "savedmodel" | "stablehlo": {key: path}}}, all runtimes in this one
process (TensorFlow imports JAX anyway). Writes per artifact ``<format>/<key>/probabilities``,
``.../logits`` and ``.../classes`` (from the artifact's native metadata), and fails if anything
imported normvit_jax."""
from __future__ import annotations

import json
import os
import sys

import numpy as np
from PIL import Image


def _onnx(path: str, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, list]:
    import onnxruntime as ort
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["image"]
    assert session.get_inputs()[0].type == "tensor(uint8)", session.get_inputs()[0].type
    probs, logits = session.run(["probabilities", "logits"], {"image": x})
    classes = json.loads(session.get_modelmeta().custom_metadata_map["classes"])
    return probs, logits, classes


def _savedmodel(path: str, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, list]:
    import tensorflow as tf
    loaded = tf.saved_model.load(path)
    fn = loaded.signatures["serving_default"]
    assert fn.structured_input_signature[1]["image"].dtype == tf.uint8
    out = fn(image=tf.constant(x))
    with open(loaded.classes.asset_path.numpy().decode(), encoding="utf-8") as f:
        classes = json.load(f)
    return out["probabilities"].numpy(), out["logits"].numpy(), classes


def _stablehlo(path: str, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, list]:
    import jax
    with open(path, "rb") as f:
        exp = jax.export.deserialize(bytearray(f.read()))
    assert str(exp.in_avals[0].dtype) == "uint8", exp.in_avals
    out = exp.call(x)
    with open(os.path.join(os.path.dirname(path), "classes.json"), encoding="utf-8") as f:
        classes = json.load(f)  # the format holds no metadata: the file beside it
    return np.asarray(out["probabilities"]), np.asarray(out["logits"]), classes


def main(jobs_path: str) -> None:
    with open(jobs_path, encoding="utf-8") as f:
        jobs = json.load(f)
    x = np.stack([np.asarray(Image.open(p).convert("RGB")) for p in jobs["images"]])
    runtimes = {"onnx": _onnx, "savedmodel": _savedmodel, "stablehlo": _stablehlo}
    out = {}
    for fmt, artifacts in jobs["artifacts"].items():
        for key, path in artifacts.items():
            probs, logits, classes = runtimes[fmt](path, x)
            out[f"{fmt}/{key}/probabilities"], out[f"{fmt}/{key}/logits"] = probs, logits
            out[f"{fmt}/{key}/classes"] = np.asarray(classes)
    leaked = sorted(m for m in sys.modules if m.split(".")[0] == "normvit_jax")
    assert not leaked, f"the runtime check imported {leaked}"
    np.savez(jobs["out"], **out)


if __name__ == "__main__":
    main(sys.argv[1])
