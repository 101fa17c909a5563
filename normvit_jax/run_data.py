"""The input statistics a run trained with, kept in its workdir: ``workdir/data.json``.

The model learned on pixels mapped by ``DataSpec.affine`` (``data.normalize`` with the training
set's per-channel mean/std/min/max). For a dataset prepared by the user those statistics live in
its prepare.json, which may be absent where the run is used (a workdir copied off the cluster) or
re-written since (``prepare --overwrite`` with more photos). Training writes them here when it
starts, and the inference tools (predict, export, evaluation, recalibrate, analysis) take them from
here, so a workdir is self-contained and normalizes as its model was trained. A workdir written
before this file existed falls back to the dataset (``resolve_data_spec``).

Record: ``dataset``, ``data_dir``, ``normalize``, ``image_size``, ``mean``/``std``/``min``/
``max`` (per channel, [0, 1] units) and, for a prepared dataset, ``prepared``: its examples per
split and class names (with the statistics, what recognises a dataset prepared again); None for a
built-in dataset, whose statistics are tables.

No JAX here (``workdir.prepare`` checks a resume before JAX starts).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from absl import logging
from etils import epath

from normvit_jax import run_config

RECORD_NAME = "data.json"
CLASSES_NAME = "classes.json"  # label order -> names (train/build.py writes it)
STATS = ("mean", "std", "min", "max")


class DataChangedError(ValueError):
    """Training would resume on a dataset prepared again since the run trained (exit 2)."""


def _prepared_part(name: str, data_dir: str | None, info: dict | None = None) -> dict | None:
    """What recognises a prepared dataset's version (its prepare.json, or ``info`` read from it):
    examples per split and class names; None for a built-in dataset."""
    from normvit_jax.data import dataspec, prepared
    if name in dataspec.NUM_CLASSES:
        return None
    info = info or prepared.describe(name, data_dir)
    return {"splits": {s: int(v["examples"]) for s, v in sorted(info["splits"].items())},
            "classes": list(info["classes"])}


def of_spec(spec: Any) -> dict:
    """The record of a run training on ``spec`` (its ``data.DataSpec``)."""
    rec = {"dataset": spec.name, "data_dir": spec.data_dir, "normalize": spec.normalize,
           "image_size": int(spec.image_shape[0])}
    rec.update({k: [float(v) for v in getattr(spec, k)] for k in STATS})
    rec["prepared"] = _prepared_part(spec.name, spec.data_dir)
    return rec


def path_of(workdir: str) -> epath.Path:
    return epath.Path(workdir) / RECORD_NAME


def read(workdir: str) -> dict | None:
    """The run's record; None for a workdir written before it existed."""
    path = path_of(workdir)
    if not path.exists():
        return None
    rec = run_config.read_json(path, "restore it from a copy of the run, or delete it to take "
                                     "the statistics from the dataset (it must then be the one "
                                     "the run trained on)")
    if not isinstance(rec, dict) or any(k not in rec for k in (*STATS, "normalize")):
        raise ValueError(f"{path} does not hold a run's input statistics ({', '.join(STATS)}, "
                         "normalize); restore it from a copy of the run, or delete it to take "
                         "the statistics from the dataset")
    return rec


def _fmt(v: Any) -> str:
    if isinstance(v, list) and all(isinstance(x, float) for x in v):
        return "[" + ", ".join(f"{x:.6g}" for x in v) + "]"
    return repr(v)


def changes(saved: dict, current: dict) -> list[str]:
    """What differs between two records of the same dataset: 'mean [..] -> [..]', 'examples
    of train 24 -> 30', 'classes [..] -> [..]'."""
    out = [f"{k} {_fmt(saved[k])} -> {_fmt(current[k])}" for k in STATS
           if saved.get(k) != current.get(k)]
    a, b = saved.get("prepared") or {}, current.get("prepared") or {}
    sa, sb = a.get("splits") or {}, b.get("splits") or {}
    out += [f"examples of {s} {sa.get(s, 0)} -> {sb.get(s, 0)}" for s in sorted(set(sa) | set(sb))
            if sa.get(s) != sb.get(s)]
    if a.get("classes") != b.get("classes"):
        out.append(f"classes {a.get('classes')} -> {b.get('classes')}")
    return out


def _reprepared(saved: dict, current: dict) -> list[str]:
    """``changes`` of the same dataset; [] when the config names another one (a config change,
    which run_config's check decides)."""
    if saved.get("dataset") != current.get("dataset"):
        return []
    return changes(saved, current)


def check_resume(workdir: str, current: dict, allow_change: bool) -> None:
    """Refuses (DataChangedError, one line) to continue a run whose dataset was prepared again
    since it trained: other statistics or examples break the exact continuation (docs/faults.md)
    unless ``allow_change`` (``config.allow_config_change``). A run without a checkpoint trained
    on nothing yet: it takes the dataset as it is now (``write`` keeps the old record). A damaged
    data.json or classes.json is a ValueError naming it (``read``, ``check_classes``)."""
    check_classes(workdir)
    saved = read(workdir)
    if saved is None or allow_change or not run_config.has_checkpoint(workdir):
        return
    diff = _reprepared(saved, current)
    if diff:
        raise DataChangedError(
            f"{workdir} trained on dataset {current['dataset']!r}, which has been prepared again "
            f"since ({'; '.join(diff)}): resuming would not continue the run exactly. Use another "
            "--workdir, pass --config.allow_config_change=True to continue this run on the new "
            f"data ({RECORD_NAME} is updated, the old one kept), or --fresh to start over.")


def check_classes(workdir: str) -> None:
    """A damaged ``classes.json`` (not JSON, not a list) is a ValueError naming it, as a damaged
    data.json is: training wrote the dataset's names over it without a word, while predict
    refused it (docs/faults.md: exit 2 for both)."""
    path = epath.Path(workdir) / CLASSES_NAME
    if not path.exists():
        return
    advice = ("restore it from a copy of the run, or delete it: training writes the dataset's "
              "class names again")
    names = run_config.read_json(path, advice)
    if not isinstance(names, list):
        raise ValueError(f"{path} is not a list of class names (JSON {type(names).__name__}); "
                         f"{advice}")


def write(workdir: str, record: dict) -> None:
    """Writes the record (atomically) when the run starts; a changed one (a change allowed by
    ``allow_config_change``, or a run that had no checkpoint yet) keeps the old file as
    data.before-<time>.json, as config.json does."""
    path = path_of(workdir)
    if path.exists():
        old = path.read_text()
        saved = read(workdir)
        if saved == record:
            return
        diff = _reprepared(saved, record)
        if diff and run_config.has_checkpoint(workdir):
            logging.warning("Continuing %s on dataset %r as prepared now (allow_config_change): "
                            "%s.", workdir, record["dataset"], "; ".join(diff))
        (path.parent / f"data.before-{run_config.utc_stamp()}.json").write_text(old)
    run_config.write_json_atomic(workdir, RECORD_NAME, record)


def _warn_if_reprepared(workdir: str, saved: dict, name: str, data_dir: str | None) -> None:
    """One warning line when the run's dataset is reachable here and was prepared again since
    the run trained (its statistics are not the ones the model learned with)."""
    from normvit_jax.data import prepared
    if saved.get("prepared") is None or saved.get("dataset") != name \
            or not prepared.is_prepared(name, data_dir):
        return
    try:
        info = prepared.describe(name, data_dir)  # prepare.json, read once
    except ValueError as e:  # damaged since: the run's own statistics do not need it
        logging.warning("%s; %s uses the statistics it trained with, from %s.",
                        str(e).split("; ")[0], workdir, path_of(workdir))
        return
    current = dict(saved, prepared=_prepared_part(name, data_dir, info))
    st = info["stats"]
    current.update({k: [float(v) for v in st[k]] for k in STATS})
    diff = changes(saved, current)
    if diff:
        logging.warning("Dataset %r in %s was prepared again since the run %s trained (%s); "
                        "using the statistics the run trained with, from %s (%s).", name,
                        data_dir or prepared.default_data_dir(), workdir, "; ".join(diff),
                        path_of(workdir), ", ".join(f"{k} {_fmt(saved[k])}" for k in STATS))


def apply(spec: Any, record: dict | None) -> Any:
    """``spec`` (a ``data.DataSpec``) with the recorded normalization and statistics."""
    if record is None:
        return spec
    return dataclasses.replace(spec, normalize=record["normalize"],
                               **{k: tuple(float(v) for v in record[k]) for k in STATS})


def inference_spec(workdir: str, spec: Any) -> Any:
    """``spec`` as the run trained: its recorded statistics when the workdir has them (a
    dataset prepared again since is named in one warning), else ``spec`` unchanged."""
    saved = read(workdir)
    if saved is not None:
        _warn_if_reprepared(workdir, saved, spec.name, spec.data_dir)
    return apply(spec, saved)


def affine(workdir: str | None, config: Any) -> tuple[np.ndarray, np.ndarray]:
    """(scale, shift) the run's model input was made with: from its record, without the dataset
    (warned about when it is here and was prepared again); a workdir without one (or ``None``)
    resolves the dataset of ``config`` (``resolve_data_spec``)."""
    from normvit_jax.data import dataspec, stats
    saved = read(workdir) if workdir is not None else None
    if saved is None:
        return dataspec.resolve_data_spec(config).affine
    d = config.data
    _warn_if_reprepared(workdir, saved, d.name, d.get("data_dir"))
    f = lambda v: np.asarray(v, np.float32)  # noqa: E731
    return stats.affine_of({k: f(saved[k]) for k in STATS}, saved["normalize"])
