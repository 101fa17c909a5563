"""Writes an artifact and the files beside it; finds them again for a reader (serve, tests).

Beside every artifact (docs/deploy.md): ``classes.json`` (the class names, index order) and the
metadata (``<file>.json`` beside an ONNX or StableHLO file; ``deploy.json`` inside a SavedModel
folder, which also holds both as TF assets): the format, the input and outputs, the eval
geometry a caller applies before the artifact, and where the weights came from.
"""
from __future__ import annotations

import json
import os
from typing import Any, Callable

from normvit_jax.deploy import bundle as bundle_lib
from normvit_jax.deploy.errors import DeployError

FORMATS = ("onnx", "savedmodel", "stablehlo")
METADATA_VERSION = 1


def metadata(b: bundle_lib.Bundle, fmt: str, batch: int | None) -> dict:
    """The artifact's self-description (the same keys in every format)."""
    size = b.image_size
    return {
        "metadata_version": METADATA_VERSION,
        "format": fmt,
        "input": {"name": bundle_lib.INPUT, "dtype": "uint8", "shape": [batch, size, size, 3],
                  "layout": "NHWC, RGB pixels 0..255 after the eval crop and resize"},
        "outputs": {"probabilities": {"dtype": "float32", "shape": [batch, b.num_classes]},
                    "logits": {"dtype": "float32", "shape": [batch, b.num_classes]}},
        "num_classes": b.num_classes,
        "classes": "classes.json",
        "normalize_in_graph": {"scale": [float(v) for v in b.affine[0]],
                               "shift": [float(v) for v in b.affine[1]]},
        "preprocess": b.preprocess,
        "source": b.source,
    }


def sidecar_paths(path: str) -> tuple[str, str]:
    """(classes.json, metadata json) of an artifact at ``path``."""
    path = os.path.normpath(path)
    if os.path.isdir(path):
        return os.path.join(path, "classes.json"), os.path.join(path, "deploy.json")
    return os.path.join(os.path.dirname(path), "classes.json"), path + ".json"


def read_metadata(path: str) -> tuple[dict, list[str]]:
    """(metadata, class names) written beside the artifact at ``path``."""
    classes_path, meta_path = sidecar_paths(path)
    for p in (meta_path, classes_path):
        if not os.path.isfile(p):
            raise DeployError(f"{p} not found: {path} is not an artifact written by python -m "
                              "normvit_jax.export --format=onnx|savedmodel|stablehlo")
    with open(meta_path, encoding="utf-8") as f:
        meta = json.load(f)
    with open(classes_path, encoding="utf-8") as f:
        names = [str(c) for c in json.load(f)]
    return meta, names


def _write_json(path: str, value: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2)
    os.replace(tmp, path)


def _writer(fmt: str) -> Callable:
    if fmt == "onnx":
        from normvit_jax.deploy import onnx_format as m
    elif fmt == "savedmodel":
        from normvit_jax.deploy import savedmodel_format as m
    elif fmt == "stablehlo":
        from normvit_jax.deploy import stablehlo_format as m
    else:
        raise DeployError(f"--format={fmt!r} is not an artifact format; accepted: npz, "
                          + ", ".join(FORMATS))
    return m.write


def export_artifact(b: bundle_lib.Bundle, fmt: str, out: str, batch: int | None = None,
                    log: Callable[[str], Any] | None = print) -> dict:
    """Writes the ``fmt`` artifact of ``b`` at ``out`` and the files beside it; returns its
    metadata. ``batch``: a fixed batch size (default: any, a dynamic first dimension)."""
    if batch is not None and batch < 1:
        raise DeployError(f"--batch={batch}: must be >= 1 (leave it out for a dynamic batch)")
    if "://" in out:
        raise DeployError(f"--out={out}: artifacts are written to a local path")
    write = _writer(fmt)
    meta = metadata(b, fmt, batch)
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    write(b, out, batch, meta)
    classes_path, meta_path = sidecar_paths(out)
    _write_json(classes_path, list(b.class_names))
    _write_json(meta_path, meta)
    if log is not None:
        shape = "N" if batch is None else str(batch)
        log(f"exported the {fmt} artifact to {out}: image uint8 ({shape}, {b.image_size}, "
            f"{b.image_size}, 3) -> probabilities, logits float32 ({shape}, {b.num_classes}); "
            f"{classes_path} and {meta_path} beside it")
    return meta
