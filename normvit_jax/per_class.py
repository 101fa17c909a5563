"""Per-class results of ``--mode=eval``: each class's top-1, what the model takes it for, and a
confusion-matrix picture (``evaluation.evaluate_checkpoint``).

The counts come out of the eval step's own forward pass as extra sums (``sums``): the whole
confusion matrix (rows: true class, columns: the top-1 prediction, ``jnp.argmax`` as the top-1
metric takes it) up to ``CONFUSION_MAX_CLASSES`` classes, beyond that each class's images and
hits only (the matrix is summed on the device: 4 MB at 1,000 classes, 1.7 GB at 21k).
``summarize`` turns them into the result file's ``per_class``; ``picture`` draws the matrix.
"""
from __future__ import annotations

import json
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath

CONFUSION_MAX_CLASSES = 1000  # above: per-class images and hits, no matrix
JSON_MATRIX_MAX_CLASSES = 100  # the matrix itself in the result file (and on stdout)
PICTURE_MAX_CLASSES = 50       # a picture whose rows and columns still carry readable names
MOST_CONFUSED = 10             # (true, predicted) pairs listed, most frequent first
_KEYS = ("confusion", "class_examples", "class_hits")


def sums(logits: jax.Array, batch: dict) -> dict[str, jax.Array]:
    """The eval step's per-class sums of one batch over its real rows (``batch['mask']``):
    ``{'confusion': (C, C) int32}``, or above CONFUSION_MAX_CLASSES classes
    ``{'class_examples', 'class_hits': (C,) int32}``."""
    c = logits.shape[-1]
    real = (batch["mask"] > 0).astype(jnp.int32)
    labels = batch["label"].astype(jnp.int32)
    pred = jnp.argmax(logits, -1)  # the top-1 metric's prediction (a NaN row: its first NaN)
    if c <= CONFUSION_MAX_CLASSES:
        return {"confusion": jnp.zeros((c, c), jnp.int32).at[labels, pred].add(real)}
    return {"class_examples": jnp.zeros(c, jnp.int32).at[labels].add(real),
            "class_hits": jnp.zeros(c, jnp.int32).at[labels].add(real * (pred == labels))}


def pop_counts(metrics: dict[str, Any]) -> dict[str, dict[str, np.ndarray]]:
    """Takes the summed per-class arrays out of ``setup.evaluate``'s metrics (which keep their
    scalars): ``{'': {...}, 'ema_': {...}}``, a prefix per set of weights evaluated."""
    out: dict[str, dict[str, np.ndarray]] = {}
    for prefix in ("", "ema_"):
        got = {k: np.asarray(metrics.pop(prefix + k)) for k in _KEYS if prefix + k in metrics}
        if got:
            out[prefix] = got
    return out


def class_names(workdir: str, spec: Any, num_classes: int) -> list[str]:
    """The run's class names (its classes.json, else the dataset's), else the label numbers; a
    damaged classes.json only costs the names here (predict and export refuse it)."""
    names: Any = None
    try:
        names = json.loads((epath.Path(workdir) / "classes.json").read_text())
    except (OSError, ValueError):
        pass
    if not (isinstance(names, list) and len(names) == num_classes):
        names = spec.class_names
    if names is None or len(names) != num_classes:
        return [str(i) for i in range(num_classes)]
    return [str(n) for n in names]


def summarize(counts: dict[str, np.ndarray], names: Sequence[str]) -> dict[str, Any]:
    """The result file's ``per_class``: ``classes``, ``examples`` (images of each class in the
    split), ``top1`` (None for a class without images), and from a confusion matrix also
    ``most_confused`` (the MOST_CONFUSED most frequent mistakes: true class, predicted class,
    count, of how many images of the true class) and, up to JSON_MATRIX_MAX_CLASSES classes, the
    matrix itself as ``confusion`` (rows true, columns predicted)."""
    m = counts.get("confusion")
    if m is not None:
        examples, hits = m.sum(1), np.diagonal(m)
    else:
        examples, hits = counts["class_examples"], counts["class_hits"]
    out: dict[str, Any] = {
        "classes": list(names), "examples": [int(e) for e in examples],
        "top1": [float(h / e) if e else None for h, e in zip(hits, examples)]}
    if m is None:
        return out
    off = m.astype(np.int64)
    np.fill_diagonal(off, 0)
    order = np.argsort(-off, axis=None, kind="stable")[:MOST_CONFUSED]  # ties: lower index first
    out["most_confused"] = [
        {"true": names[i], "predicted": names[j], "count": int(off[i, j]), "of": int(examples[i])}
        for i, j in zip(*np.unravel_index(order, off.shape)) if off[i, j] > 0]
    if len(names) <= JSON_MATRIX_MAX_CLASSES:
        out["confusion"] = m.astype(int).tolist()
    return out


def describe(per_class: dict[str, Any], lowest: int = 3) -> str:
    """One log line: the classes with the lowest top-1 below 100% and what they were taken for
    most."""
    mistakes: dict[str, tuple[str, int]] = {}
    for pair in per_class.get("most_confused", []):
        mistakes.setdefault(pair["true"], (pair["predicted"], pair["count"]))
    scored = [(t, n, e) for n, t, e in zip(per_class["classes"], per_class["top1"],
                                            per_class["examples"]) if t is not None and t < 1]
    parts = []
    for t, n, e in sorted(scored, key=lambda x: x[0])[:lowest]:
        taken = mistakes.get(n)
        parts.append(f"{n}: {t:.1%} of {e} images" + (f" ({taken[1]} taken for {taken[0]})"
                                                       if taken else ""))
    if parts:
        return "lowest per-class top-1: " + ", ".join(parts)
    if any(t is not None for t in per_class["top1"]):
        return "per-class top-1: 100% for every class with images"
    return "no class has images"


def picture_path(result_path: Any, prefix: str) -> Any:
    """``eval_<dataset>_<split>_<step>.json`` -> ``eval_<dataset>_<split>_confusion_<step>.png``
    (``confusion-ema`` for the EMA weights): it ends in ``_<step>.png``, so it moves with a damaged
    checkpoint of that step and with ``--fresh`` as the JSON does."""
    stem, _, step = result_path.name[:-len(".json")].rpartition("_")
    tag = "confusion-ema" if prefix == "ema_" else "confusion"
    return result_path.parent / f"{stem}_{tag}_{step}.png"


def picture(per_class: dict[str, Any], title: str, path: Any) -> bool:
    """Draws the confusion matrix (each row as fractions of its class's images, counts written in
    the cells up to 20 classes) to ``path`` (PNG, written atomically); False, nothing written, when
    there is no matrix or more than PICTURE_MAX_CLASSES classes."""
    names = per_class["classes"]
    if "confusion" not in per_class or len(names) > PICTURE_MAX_CLASSES:
        return False
    from normvit_jax.analysis import figures  # matplotlib only when a picture is drawn
    with figures.plain_text():  # names as they are, never TeX math
        m = np.asarray(per_class["confusion"], np.float64)
        rows = m / np.maximum(m.sum(1, keepdims=True), 1)
        c = len(names)
        side = float(np.clip(2.5 + 0.3 * c, 4.5, 16))
        fig = figures.figure(side + 1.2, side)
        ax = fig.add_subplot()
        im = ax.imshow(rows, cmap="Blues", vmin=0, vmax=1)
        short = [n if len(n) <= 18 else n[:17] + "…" for n in names]
        fontsize = 8 if c <= 20 else 6
        ax.set_xticks(range(c), short, rotation=90, fontsize=fontsize)
        ax.set_yticks(range(c), [f"{n} ({e})" for n, e in zip(short, per_class["examples"])],
                      fontsize=fontsize)
        ax.set_xlabel("predicted class (top-1)")
        ax.set_ylabel("true class (its images)")
        if c <= 20:
            for (i, j), n in np.ndenumerate(m):
                if n:
                    ax.text(j, i, f"{int(n)}", ha="center", va="center", fontsize=fontsize,
                            color="white" if rows[i, j] > 0.5 else "black")
        fig.colorbar(im, ax=ax, shrink=0.8, label="fraction of the true class's images")
        figures.suptitle(fig, title)
        figures.save(fig, path)  # local or gs://, as the result file
    return True
