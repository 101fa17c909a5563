"""Writes an artifact and the files beside it; finds them again for a reader (serve, tests).

Beside every artifact (docs/deploy.md): ``classes.json`` (the class names, index order) and the
metadata (``<file>.json`` beside an ONNX or StableHLO file; ``deploy.json`` inside a SavedModel
folder, which also holds both as TF assets): the format, the input and outputs, the eval
geometry a caller applies before the artifact, and where the weights came from.
"""
from __future__ import annotations

import errno
import json
import os
from typing import Any, Callable

from normvit_jax import run_config
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
    if not os.path.exists(path):  # (not "its .json not found": the path itself is wrong)
        raise DeployError(f"{path} does not exist: pass the file (onnx, stablehlo) or folder "
                          "(savedmodel) that python -m normvit_jax.export --out=... wrote")
    classes_path, meta_path = sidecar_paths(path)
    for p in (meta_path, classes_path):
        if not os.path.isfile(p):
            raise DeployError(f"{p} not found: {path} is not an artifact written by python -m "
                              "normvit_jax.export --format=onnx|savedmodel|stablehlo")
    meta = run_config.read_json(meta_path, "export the artifact again", DeployError)
    if not isinstance(meta, dict):  # valid JSON of another shape: not a traceback in serve
        raise DeployError(f"{meta_path} is not an artifact's metadata (a JSON object); export "
                          "the artifact again")
    names = read_class_names(classes_path, "export the artifact again")
    if len(names) != meta.get("num_classes", len(names)):
        raise DeployError(f"{classes_path} names {len(names)} classes, the artifact {path} has "
                          f"{meta['num_classes']}: it belongs to another artifact")
    return meta, names


def read_class_names(path: str, advice: str) -> list[str]:
    """The class names in a ``classes.json``; a damaged one, or JSON that is not a list, is a
    DeployError naming the file and saying what to do (``advice``)."""
    names = run_config.read_json(path, advice, DeployError)
    if not isinstance(names, list):
        raise DeployError(f"{path} is not a list of class names (JSON {type(names).__name__}); "
                          f"{advice}")
    return [str(c) for c in names]


def _refuse_other_folder(fmt: str, out: str) -> None:
    """A SavedModel replaces its folder: only an empty one or an earlier export is replaced, never
    a folder of other files given by mistake (a run's workdir, '.'), which was deleted."""
    if fmt != "savedmodel" or not os.path.isdir(out) or not os.listdir(out):
        return
    if not {"saved_model.pb", "deploy.json"} <= set(os.listdir(out)):
        raise DeployError(f"--out={out} holds other files than a SavedModel written by this "
                          "export, and the export replaces its folder: pass a new or empty folder")


def _refuse_other_classes(fmt: str, out: str, names: list[str]) -> None:
    """ONNX and StableHLO files in one folder share its ``classes.json``: a model with other
    classes would relabel every other artifact there, so it is refused before anything is
    written (re-exporting the same path may change them: nothing else reads them)."""
    if fmt == "savedmodel":  # a folder of its own
        return
    out = os.path.abspath(out)
    folder = os.path.dirname(out)
    classes_path = os.path.join(folder, "classes.json")
    if not os.path.isfile(classes_path):
        return
    others = sorted(n[:-5] for n in os.listdir(folder)
                    if n.endswith(".json") and n != "classes.json"
                    and os.path.join(folder, n[:-5]) != out
                    and os.path.isfile(os.path.join(folder, n[:-5])))
    if not others:
        return
    whose = others[0] + (f" and {len(others) - 1} more" if len(others) > 1 else "")
    # damaged: named as such (it was refused as "other class names", which sent people looking
    # for a model they never exported); not rewritten, as it may hold their names yet
    there = read_class_names(classes_path, f"it names the classes of {whose} in this folder: "
                                           "restore it, or export to another folder")
    if there != names:
        raise DeployError(f"{classes_path} holds the class names of {whose}, not this model's "
                          f"({len(names)} classes): export it to another folder")


def _write_json(path: str, value: Any, rename: bool = True) -> None:
    """Writes ``path``.tmp, then (``rename``) renames it to ``path``."""
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2)
    if rename:
        os.replace(tmp, path)


def _remove(*paths: str) -> None:
    for path in paths:
        try:
            os.remove(path)
        except OSError:
            pass


def _write_failed(out: str, e: OSError) -> DeployError:
    """A target that cannot be written (a full disk): one line, exit 2; nothing half-written
    left (an artifact already there is untouched)."""
    hint = "free disk space" if e.errno == errno.ENOSPC else "fix its permissions"
    return DeployError(f"cannot write --out={out} ({type(e).__name__}: {e}); nothing was "
                       f"exported: {hint} or pass another --out")


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
    _refuse_other_classes(fmt, out, list(b.class_names))
    _refuse_other_folder(fmt, out)
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    classes_path, meta_path = sidecar_paths(out)
    if fmt == "savedmodel":  # a folder holding its sidecars: the writer stages it as a whole
        try:
            write(b, out, batch, meta)
            classes_path, meta_path = sidecar_paths(out)  # in the folder, now that it exists
            _write_json(classes_path, list(b.class_names))
            _write_json(meta_path, meta)
        except OSError as e:
            _remove(classes_path + ".tmp", meta_path + ".tmp")
            raise _write_failed(out, e) from None
    else:  # the sidecars and the model to temporary names; the model renamed into place last
        staging = out + ".new"
        try:
            _write_json(classes_path, list(b.class_names), rename=False)
            _write_json(meta_path, meta, rename=False)
            write(b, staging, batch, meta)
            os.replace(classes_path + ".tmp", classes_path)
            os.replace(meta_path + ".tmp", meta_path)
            os.replace(staging, out)
        except OSError as e:
            _remove(classes_path + ".tmp", meta_path + ".tmp", staging, staging + ".tmp")
            raise _write_failed(out, e) from None
    if log is not None:
        shape = "N" if batch is None else str(batch)
        log(f"exported the {fmt} artifact to {out}: image uint8 ({shape}, {b.image_size}, "
            f"{b.image_size}, 3) -> probabilities, logits float32 ({shape}, {b.num_classes}); "
            f"{classes_path} and {meta_path} " + ("in it" if fmt == "savedmodel" else "beside it"))
    return meta
