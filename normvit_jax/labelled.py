"""``predict --labels=folders``: images sorted into folders named as the run's classes (prepare's
``DIR/<class>/...`` layout), scored without preparing a dataset: each row's true class, the top-1
over them, the weakest classes, each wrong image, and two pictures beside ``--out``: the confusion
matrix and the wrong images as the model saw them.
"""
from __future__ import annotations

import math
import os
import sys
from typing import Any, Sequence

import numpy as np

WRONG_PICTURE_MAX = 36  # wrong images drawn (all are listed)


def folder_labels(spec: str) -> dict[str, str | None]:
    """Each file of ``--images`` (listed as ``predict.list_images`` lists them) with its class
    folder's name: the first folder below the named folder it was found in
    (``new/roses/2024/a.jpg`` under ``--images=new``: 'roses'), or a named file's own folder; None
    for a file directly in a named folder."""
    from normvit_jax.predict import _paths, list_images
    out: dict[str, str | None] = {}
    for part in _paths(spec):
        if os.path.isdir(part):
            for f in list_images(part):
                head = os.path.relpath(f, part).split(os.sep)
                out[f] = head[0] if len(head) > 1 else None
        else:
            out[part] = os.path.basename(os.path.dirname(os.path.abspath(part))) or None
    return out


def check_labels(labels: dict[str, str | None], names: Sequence[str]) -> None:
    """ValueError (exit 2, one line) unless every file lies in a folder named as a class."""
    from normvit_jax.data.formats import shown
    loose = [p for p, c in labels.items() if c is None]
    if loose:
        folder = os.path.dirname(os.path.abspath(loose[0]))
        hint = (f"; {shown(folder)} is itself the class folder of {os.path.basename(folder)!r}: "
                f"pass --images={shown(os.path.dirname(folder))}, the folder that holds the class "
                f"folders" if os.path.basename(folder) in set(names) else
                "; put each in a folder named as its class")
        raise ValueError(f"--labels=folders: {len(loose)} image(s) are not in a class folder, "
                         f"e.g. {shown(loose[0])}{hint}")
    unknown = sorted({c for c in labels.values() if c not in set(names)})
    if unknown:
        listed = ", ".join(names[:20]) + (f" and {len(names) - 20} more" if len(names) > 20 else "")
        raise ValueError(f"--labels=folders: the folder(s) {', '.join(map(repr, unknown[:10]))} "
                         f"are not classes of the run (its classes: {listed}); name each class "
                         f"folder as the class it holds")


def summary(rows: list[dict], labels: dict[str, str | None], names: Sequence[str]
            ) -> tuple[list[str], dict[str, Any]]:
    """Adds 'true' and 'correct' to each row; returns the summary lines (top-1, the lowest
    classes, each wrong image) and per_class.summarize's result over these rows (the classes
    they are in or were taken for)."""
    from normvit_jax import per_class
    from normvit_jax.data.formats import shown
    index = {n: i for i, n in enumerate(names)}
    if any(row["top"][0][0] not in index for row in rows):  # classes.json of another class count
        raise ValueError(f"--labels=folders: the model's classes are not the run's "
                         f"{len(names)} class names (classes.json): predicted "
                         f"{next(r['top'][0][0] for r in rows if r['top'][0][0] not in index)!r}")
    confusion = np.zeros((len(names),) * 2, np.int64)
    wrong = []
    for row in rows:
        row["true"] = labels[row["path"]]
        row["correct"] = row["top"][0][0] == row["true"]
        confusion[index[row["true"]], index[row["top"][0][0]]] += 1
        if not row["correct"]:
            wrong.append(f"wrong: {shown(row['path'])}: {row['true']}, taken for "
                         f"{row['top'][0][0]} {row['top'][0][1]:.3f}")
    # the classes these images are or were taken for (3 folders of a 50-class run: not 50 rows)
    used = np.flatnonzero(confusion.sum(0) + confusion.sum(1))
    result = per_class.summarize({"confusion": confusion[np.ix_(used, used)]},
                                 [names[i] for i in used])
    hits = int(np.trace(confusion))
    in_top = sum(any(c == row["true"] for c, _ in row["top"]) for row in rows)
    lines = [f"labelled by their folders: top-1 {hits / len(rows):.2%} ({hits} of {len(rows)}), "
             f"in the top {len(rows[0]['top'])} {in_top / len(rows):.2%}",
             per_class.describe(result), *wrong]
    return lines, result


def pictures(result: dict[str, Any], rows: list[dict], out: str, workdir: str, geometry: Any
             ) -> None:
    """Beside ``out`` (P.csv): P_confusion.png (up to per_class.PICTURE_MAX_CLASSES classes) and,
    when some are wrong, P_wrong.png (the first WRONG_PICTURE_MAX wrong images at the model's
    input, through predict's decoder and ``geometry``). Each written is printed; one that cannot be
    written is one line on stderr (the results are printed and in the CSV already)."""
    from normvit_jax import per_class
    stem = os.path.splitext(out)[0]
    hits = sum(r["correct"] for r in rows)
    run = os.path.basename(os.path.normpath(workdir))
    title = f"{run} on {len(rows)} images labelled by their folders: top-1 {hits / len(rows):.2%}"
    wrong = [r for r in rows if not r["correct"]]
    for path, draw in ((f"{stem}_confusion.png", lambda p: per_class.picture(result, title, p)),
                       (f"{stem}_wrong.png", lambda p: bool(wrong) and _wrong_picture(
                           wrong, geometry, f"{run}: {len(wrong)} of {len(rows)} images wrong", p))):
        try:
            if draw(path):
                print(f"wrote {'the confusion matrix' if 'confusion' in path else 'the wrong images'}"
                      f" to {path}")
        except Exception as e:  # noqa: BLE001  (a picture never costs the printed results)
            print(f"could not write {path} ({type(e).__name__}: {str(e).strip()[:200]}); the "
                  f"results are above", file=sys.stderr)


def _wrong_picture(wrong: list[dict], geometry: Any, title: str, path: str) -> bool:
    """A grid of the wrong images as the model saw them (the eval crop at the model's size), each
    titled 'true -> predicted p' and its file name."""
    from normvit_jax.analysis import figures
    from normvit_jax.data import tf_images
    from normvit_jax.predict import _decode
    shown = wrong[:WRONG_PICTURE_MAX]
    kept, x, _ = _decode([r["path"] for r in shown], geometry, tf_images.BatchDecoder(2))
    pixels = dict(zip(kept, x))
    shown = [r for r in shown if r["path"] in pixels]  # (decoded once already: all are)
    if not shown:
        return False
    with figures.plain_text():  # file and class names as they are, never TeX math
        cols = min(6, len(shown))
        n_rows = math.ceil(len(shown) / cols)
        fig = figures.figure(1.9 * cols, 2.0 * n_rows + 0.5)
        for i, r in enumerate(shown):
            ax = fig.add_subplot(n_rows, cols, i + 1)
            ax.imshow(pixels[r["path"]], interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            name = os.path.basename(r["path"])
            ax.set_title(f"{r['true']} -> {r['top'][0][0]} {r['top'][0][1]:.2f}\n"
                         f"{name if len(name) <= 22 else name[:21] + '…'}", fontsize=7)
        more = f" (the first {len(shown)})" if len(wrong) > len(shown) else ""
        figures.suptitle(fig, title + more + ": true -> predicted, probability")
        figures.save(fig, path)
    return True
