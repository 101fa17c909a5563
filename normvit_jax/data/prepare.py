"""Prepare your own images as a tfds dataset that training, evaluation and predict read.

    python -m normvit_jax.data.prepare --src=PATH --name=NAME --data_dir=DIR

--src is a folder of images in class folders (DIR/<split>/<class>/<image> with splits train and
val|validation|test, or one DIR/<class>/<image> tree of which --val_fraction is held out), an .npz
file or folder of .npz/.npy arrays, a CIFAR-10/100 archive (binary or python, .tar.gz or
extracted), or a folder of IDX files (MNIST, Fashion-MNIST, KMNIST). The result is a standard
tfds dataset in <data_dir>/<name>/1.0.0 (array_record, encoded images, class names) with
prepare.json (statistics, sizes, skipped files); it is written in <data_dir>/.<name>.partial and
renamed into place when complete, so an interrupted run leaves nothing that reads as prepared (run
it again to start over). Unreadable images are skipped and named (--strict refuses them); any other
bad input stops with exit 2 and one line naming the file. docs/data.md has every rule.
"""
from __future__ import annotations

import collections
import concurrent.futures as cf
import contextlib
import hashlib
import io
import json
import logging
import math
import os
import re
import shutil
import sys
import time
from typing import Any, Iterator, Sequence

import numpy as np

from normvit_jax.data import archives, formats, images, prepared, tfds_source
from normvit_jax.data.formats import PrepareError

EXIT_BAD_INPUT = 2
_NAME = re.compile(r"[a-z][a-z0-9_]*")


class _Stats:
    """Per-channel mean/std of the train split's images, each image counting once, as the model
    sees it (``stats_histogram``: its 64x64 resize), in [0, 1] units, from per-channel 256-bin
    histograms (float64; moments taken at the end). Counted over every full-resolution pixel,
    one 8000x6000 photo outweighed 10,000 images of 64x64. min/max are the full-resolution
    pixels' (``pixel_range``): the resize's antialiasing smooths extremes away (one white pixel
    in a 200x200 grey image is not in its 64x64 resize), and ``data.normalize=minmax`` must map
    every real pixel into [0, 1]."""

    def __init__(self) -> None:
        self.hist = np.zeros((3, 256), np.float64)
        self.lo = np.full(3, 255, np.int64)
        self.hi = np.zeros(3, np.int64)
        self.seen = False

    def add(self, hist: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> None:
        """Adds one image's ``stats_histogram`` and its ``pixel_range``."""
        self.hist += hist
        self.lo, self.hi = np.minimum(self.lo, lo), np.maximum(self.hi, hi)
        self.seen = True

    def result(self) -> dict[str, list[float]]:
        v = np.arange(256, dtype=np.float64) / 255.0
        n = np.maximum(self.hist.sum(1), 1).astype(np.float64)
        mean = (self.hist * v).sum(1) / n
        std = np.sqrt(np.maximum((self.hist * (v - mean[:, None]) ** 2).sum(1) / n, 0.0))
        lo = self.lo / 255.0 if self.seen else np.zeros(3)
        hi = self.hi / 255.0 if self.seen else np.ones(3)
        r = lambda a: [round(float(t), 6) for t in a]  # noqa: E731
        return dict(mean=r(mean), std=r(std), min=r(lo), max=r(hi))


_HIST_CHUNK = 1 << 18  # pixels per bincount: its int64 copy stays 6 MB at any image size


def histogram(rgb: np.ndarray) -> np.ndarray:
    """int64 (3, 256): per-channel counts of a uint8 (H, W, 3) image. On the decode threads, in
    contiguous chunks: in the writer, one thread, bincount over strided columns (an int64 copy of
    each, 0.4 GB at 48 MP) took 0.2 s per 12 MP photo, longer than a decode, and capped prepare
    at ~5 photos/s however many cores decoded."""
    x = rgb.reshape(-1, 3)
    out = np.zeros((3, 256), np.int64)
    for s in range(0, len(x), _HIST_CHUNK):
        y = np.ascontiguousarray(x[s:s + _HIST_CHUNK].T)
        for c in range(3):
            out[c] += np.bincount(y[c], minlength=256)
    return out


STATS_SIDE = 64  # an image larger than STATS_SIDE x STATS_SIDE pixels counts as its resize to it


def stats_histogram(rgb: np.ndarray) -> np.ndarray:
    """float64 (3, 256) per-channel histogram of a uint8 (H, W, 3) image that sums to 1 per
    channel: each image weighs the same in the statistics. An image of more than 64x64 pixels is
    first resized to 64x64 (PIL's bilinear, antialiased when shrinking: the pipeline's default
    resize; the aspect ratio is not kept, as a random resized crop does not keep it), so that its
    pixels are those the model sees rather than its sensor's noise; smaller ones (CIFAR, MNIST)
    count as they are, so that a dataset of one size gets its pixels' own statistics."""
    h, w = rgb.shape[:2]
    if h * w > STATS_SIDE * STATS_SIDE:
        from PIL import Image
        rgb = np.asarray(Image.fromarray(rgb, "RGB").resize((STATS_SIDE, STATS_SIDE),
                                                             Image.BILINEAR))
    return histogram(rgb) / float(rgb.shape[0] * rgb.shape[1])


def pixel_range(rgb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel (min, max) of a uint8 (H, W, 3) image at full resolution."""
    x = rgb.reshape(-1, 3)
    return x.min(0), x.max(0)


class _Copies:
    """Images whose stored bytes are identical to an earlier one's under another class (a photo
    copied into two class folders: trained with both labels) or in another split (a photo in
    train and in the eval split: evaluated on an image the model trained on). Both were written
    without a word; they are counted, named in prepare.json and noted in the summary."""

    def __init__(self, classes: Sequence[str]) -> None:
        self.classes, self.first, self.found = classes, {}, []

    def add(self, data: bytes, split: str, label: int, name: str) -> None:
        key = hashlib.blake2b(data, digest_size=16).digest()
        first = self.first.setdefault(key, (split, label, name))
        if first[1] != label or first[0] != split:
            self.found.append(dict(file=name, split=split, label=self.classes[label],
                                   copy_of=first[2], copy_split=first[0],
                                   copy_label=self.classes[first[1]]))


class _SplitWriter:
    """Loads a split's images on a thread pool (PIL releases the GIL while decoding) and yields
    tfds (key, example) pairs in order, recording sizes, skipped files and statistics."""

    def __init__(self, name: str, split: formats.Split, num_classes: int, strict: bool,
                 workers: int, stats: _Stats | None, copies: _Copies | None = None):
        self.name, self.split, self.strict, self.workers, self.stats = name, split, strict, \
            workers, stats
        self.copies = copies
        self.per_class = np.zeros(num_classes, np.int64)
        self.skipped: list[str] = []
        self.skipped_per_class = np.zeros(num_classes, np.int64)
        self.first_skipped: dict[int, str] = {}  # label -> its first skipped file (and why)
        self.min_size, self.max_size = [1 << 30, 1 << 30], [0, 0]

    def _load(self, i: int) -> Any:
        """(stored bytes, (H, W), (histogram, min, max) or None) of example i, or its
        BadImageError."""
        try:
            data, rgb = self.split.load(i)
        except images.BadImageError as e:
            return e
        if self.stats is None:
            return data, rgb.shape[:2], None
        return data, rgb.shape[:2], (stats_histogram(rgb), *pixel_range(rgb))

    def _loaded(self, ex: cf.ThreadPoolExecutor, n: int) -> Iterator[Any]:
        """``_load(i)`` for i in 0..n-1, in order, with at most 2 x workers images decoded or
        decoding ahead of the one consumed. Each held its decoded photo (36 MB of RGB at 12 MP;
        now its encoding, size and histogram), and the look-ahead of 256 held up to 256 of them
        (9 GB of 12 MP photos) whenever the writer, one thread, fell behind the decode threads
        (254 ahead, measured with 16 threads)."""
        ahead: collections.deque[cf.Future] = collections.deque()
        try:
            for i in range(n):
                while len(ahead) < 2 * self.workers and i + len(ahead) < n:
                    ahead.append(ex.submit(self._load, i + len(ahead)))
                yield ahead.popleft().result()
        finally:  # Ctrl-C, --strict: the pool's shutdown does not wait for decodes not started
            for f in ahead:
                f.cancel()

    def __iter__(self) -> Iterator[tuple[int, dict[str, Any]]]:
        from tqdm import tqdm
        n = len(self.split.labels)
        with tqdm(total=n, desc=self.name, unit="img", file=sys.stderr, dynamic_ncols=True
                  ) as bar, cf.ThreadPoolExecutor(self.workers) as ex, \
                contextlib.closing(self._loaded(ex, n)) as loaded:  # closed before the pool waits
            for i, got in enumerate(loaded):
                bar.update(1)
                if isinstance(got, images.BadImageError):
                    if self.strict:
                        raise PrepareError(f"{self.split.names[i]}: cannot be decoded "
                                           f"({got}); --strict refuses unreadable images")
                    self.skipped.append(f"{self.split.names[i]} ({got})")
                    label = int(self.split.labels[i])
                    self.skipped_per_class[label] += 1
                    self.first_skipped.setdefault(label, self.skipped[-1])
                    continue
                data, (h, w), hist = got
                self.min_size = [min(self.min_size[0], h), min(self.min_size[1], w)]
                self.max_size = [max(self.max_size[0], h), max(self.max_size[1], w)]
                label = int(self.split.labels[i])
                self.per_class[label] += 1
                if self.stats is not None:
                    self.stats.add(*hist)
                if self.copies is not None:
                    self.copies.add(data, self.name, label, self.split.names[i])
                del got  # not held while the writer takes the example
                yield i, {"image": data, "label": label}

    def info(self) -> dict[str, Any]:
        n = int(self.per_class.sum())
        return dict(examples=n, per_class=self.per_class.tolist(), skipped=self.skipped,
                    min_size=self.min_size if n else None, max_size=self.max_size if n else None)


def check_name(name: str) -> None:
    if not _NAME.fullmatch(name):
        raise PrepareError(f"--name={name!r}: accepted: lower-case letters, digits and _ starting "
                           f"with a letter (a tfds dataset name), e.g. my_flowers")
    from normvit_jax.data import dataspec
    import tensorflow_datasets as tfds  # without TensorFlow: every argument is checked first
    # tfds's own catalog only: its community list is a file on GCS, which made every prepare
    # probe Google credentials and the GCE metadata server (community names have a namespace,
    # 'ns:name', so they cannot clash with a plain NAME anyway)
    if (name in dataspec.NUM_CLASSES or name in dataspec.EVAL_ONLY_TFDS
            or name in tfds.list_builders(with_community_datasets=False)):
        raise PrepareError(f"--name={name!r} is a dataset of tfds's catalog or of this project; "
                           f"choose another name (e.g. my_{name}) so the two cannot be confused")


def parse_source(src: str, fmt: str | None, val_fraction: float, seed: int
                 ) -> tuple[str, formats.Parsed, dict[str, Any] | None]:
    fmt = fmt or formats.detect(src)
    if fmt == "folder":
        parsed, single = formats.read_folder(src)
    elif fmt == "arrays":
        parsed, single = formats.read_arrays(src)
    elif fmt == "cifar":
        parsed, single = archives.read_cifar(src), False
    elif fmt == "idx":
        parsed, single = archives.read_idx(src), False
    else:
        raise PrepareError(f"--format={fmt!r}; accepted: {', '.join(formats.FORMATS)}")
    formats.check_labels(parsed)
    if len(parsed.classes) < 2:  # it would train, reporting 100% on predictions that say nothing
        raise PrepareError(f"{src}: one class ({parsed.classes[0]!r}); a classifier needs two or "
                           "more: one folder per class (or labels of two or more values)")
    parsed.splits = dict(sorted(parsed.splits.items(), key=lambda kv: kv[0] != "train"))
    held = None
    if single and val_fraction > 0:
        pool = parsed.splits["train"]
        # a folder's sidecars (Google Takeout's .json per photo, .xmp, .AAE) are no images: held
        # out like photos, they left the validation split a fraction of the photos it said
        eligible = ([formats.is_image_file(p) for p in pool.names] if fmt == "folder" else None)
        parsed.splits["train"], parsed.splits["validation"] = formats.hold_out(
            pool, val_fraction, seed, eligible)
        held = dict(split="validation", fraction=val_fraction, seed=seed)
        if not len(parsed.splits["validation"].labels):
            raise PrepareError(_nothing_held_out(src, pool, parsed.classes, val_fraction))
    return fmt, parsed, held


def _nothing_held_out(src: str, pool: formats.Split, classes: Sequence[str],
                      fraction: float) -> str:
    """Names the classes and their sizes: each holds out round(fraction * n), which is 0 here."""
    counts = np.bincount(pool.labels, minlength=len(classes))
    sizes = ", ".join(f"{c!r} {n}" for c, n in sorted(zip(classes, counts.tolist()),
                                                       key=lambda cn: cn[1])[:5])
    smallest = int(counts.min())
    # round() halves to even (round(0.5) == 0): one image of every class needs f * n > 0.5
    one_each = (f"--val_fraction={math.floor(50 / smallest) / 100 + 0.01:.2f} (one image of each "
                "class) or more, or " if smallest > 1 else "")
    return (f"{src}: --val_fraction={fraction:g} holds out no example: each class holds out "
            f"round({fraction:g} x its images), which is 0 for every class (images per class: "
            f"{sizes}{', ...' if len(classes) > 5 else ''}); pass {one_each}--val_fraction=0 to "
            f"write only 'train'")


def _check_classes(writers: dict[str, Any], classes: Sequence[str], source: str) -> None:
    """A class left with no readable train image (all its files skipped) cannot be learned and
    its label would never be seen: refused like an empty class folder (docs/data.md)."""
    w = writers.get("train")
    if w is None:
        return
    # classes whose every file was skipped; an archive's class with no example at all (a cut-down
    # CIFAR) has nothing to replace and is written as it is
    empty = [i for i, n in enumerate(w.per_class) if n == 0 and w.skipped_per_class[i] > 0]
    if empty:
        i = empty[0]
        example = w.first_skipped.get(i)
        raise PrepareError(
            f"{source}: class {classes[i]!r} has no readable train image ("
            f"{int(w.skipped_per_class[i])} file(s) skipped" + (f", e.g. {example}" if example
                                                                 else "") + ")"
            + (f"; also {', '.join(repr(classes[j]) for j in empty[1:4])}" if len(empty) > 1
               else "") + "; replace the files or remove the class folder")


def eval_split_of(splits: Sequence[str]) -> str | None:
    return next((s for s in formats.EVAL_SPLIT_NAMES if s in splits), None)


def write(parsed: formats.Parsed, name: str, data_dir: str, *, strict: bool, workers: int,
          extra: dict[str, Any]) -> dict[str, Any]:
    """Writes the tfds dataset in ``<data_dir>/.<name>.partial`` and renames it into place."""
    import tensorflow_datasets as tfds
    from normvit_jax import logs
    logs.import_tensorflow_once()  # tfds imports it lazily: its start-up lines would print twice
    final = os.path.join(data_dir, name)
    tmp = os.path.join(data_dir, f".{name}.partial")
    if os.path.exists(tmp):  # an interrupted earlier run: start over
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    stats, copies = _Stats(), _Copies(parsed.classes)
    writers = {s: _SplitWriter(s, sp, len(parsed.classes), strict, workers,
                               stats if s == "train" else None, copies)
               for s, sp in parsed.splits.items()}
    features = tfds.features.FeaturesDict({
        "image": tfds.features.Image(shape=(None, None, 3), dtype=np.uint8),
        "label": tfds.features.ClassLabel(names=parsed.classes),
    })
    tfds.disable_progress_bar()  # our own bar counts images as they are decoded
    absl_logger = logging.getLogger("absl")
    level = absl_logger.level
    absl_logger.setLevel(logging.ERROR)  # tfds's notes about its temporary folders
    try:
        # tfds's "Downloading and preparing"; the empty folder of its look for the info on GCS
        with contextlib.redirect_stdout(io.StringIO()), tfds_source.no_stray_tmp_folders():
            tfds.dataset_builders.store_as_tfds_dataset(
                name=name, version=prepared.VERSION, features=features, split_datasets=writers,
                data_dir=tmp, file_format="array_record",
                description=f"Prepared by normvit_jax.data.prepare from {extra['source']}")
    except PrepareError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except (OSError, RuntimeError) as e:  # a full --data_dir (tfds: "Failed to finalize ...")
        shutil.rmtree(tmp, ignore_errors=True)
        if not _is_write_error(e):
            raise
        raise _write_failed(data_dir, e) from None
    except AssertionError:  # tfds refuses a split with no examples
        shutil.rmtree(tmp, ignore_errors=True)
        empty = [s for s, w in writers.items() if not w.per_class.sum()]
        if not empty:
            raise
        w = writers[empty[0]]
        raise PrepareError(f"{extra['source']}: split {empty[0]!r} has no readable image "
                           f"({len(w.skipped)} skipped, e.g. {w.skipped[:1]})") from None
    finally:
        absl_logger.setLevel(level)
    try:
        _check_classes(writers, parsed.classes, extra["source"])
    except PrepareError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    info = dict(extra, classes=parsed.classes, splits={s: w.info() for s, w in writers.items()},
                eval_split=eval_split_of(list(writers)), stats=stats.result(),
                ignored=parsed.ignored, copies=copies.found)
    try:
        with open(os.path.join(tmp, name, prepared.VERSION, prepared.INFO_FILE), "w",
                  encoding="utf-8") as f:
            json.dump(info, f, indent=1)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise _write_failed(data_dir, e) from None
    old = None
    if os.path.exists(final):
        old = os.path.join(data_dir, f".{name}.replaced")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(os.path.join(tmp, name), final)
    shutil.rmtree(tmp, ignore_errors=True)
    if old:
        shutil.rmtree(old, ignore_errors=True)
    return info


SHOWN_SKIPPED = 10  # skipped files the summary names per split; prepare.json has them all


def _alike(classes: Sequence[str]) -> list[list[str]]:
    """Groups of class names equal but for case and spaces ('cat', 'Cat', 'cat '): a folder's
    name typed twice is two classes, which a model cannot tell apart; shown as a note (letters
    'A' and 'a' may be meant as two)."""
    groups: dict[str, list[str]] = {}
    for c in classes:
        groups.setdefault(" ".join(c.casefold().split()), []).append(c)
    return [g for g in groups.values() if len(g) > 1]


def summary(info: dict[str, Any], name: str, data_dir: str, seconds: float,
            val_fraction: float = 0.0) -> str:
    """The lines prepare prints; ``val_fraction``: the flag's value (why there is no eval split:
    a single tree with 0, or a source with only a train split, which nothing is held out of)."""
    classes = info["classes"]
    lines = [f"prepared {name!r} in {prepared.version_dir(name, data_dir)}: {len(classes)} "
             f"classes, format {info['format']}, {seconds:.1f} s"]
    alike = _alike(classes)
    if alike:  # 'cat' and 'Cat ' merged from two sources: two labels, one concept
        lines.append(f"  note: class names that differ only in case or spaces: "
                     f"{'; '.join(' and '.join(repr(c) for c in g) for g in alike[:3])}; they are "
                     "separate classes (merge the folders if they are one)")
    for s, sp in info["splits"].items():
        per = ", ".join(f"{c} {n}" for c, n in zip(classes, sp["per_class"]))
        if len(classes) > 12:
            per = f"{min(sp['per_class'])}..{max(sp['per_class'])} per class"
        size = (f"{sp['min_size'][0]}x{sp['min_size'][1]} .. {sp['max_size'][0]}x"
                f"{sp['max_size'][1]} (HxW)" if sp["min_size"] else "no images")
        lines.append(f"  {s}: {sp['examples']} example{'' if sp['examples'] == 1 else 's'} "
                     f"({per}); sizes {size}")
        empty = [c for c, n in zip(classes, sp["per_class"]) if n == 0]
        if empty and s != "train":  # (train: refused by _check_classes)
            lines.append(f"  note: classes with no {s} image (not evaluated): "
                         f"{', '.join(empty[:8])}{' ...' if len(empty) > 8 else ''}")
        if sp["skipped"]:
            lines.append(f"  {s}: skipped {len(sp['skipped'])} unreadable file(s):")
            lines += [f"    {formats.shown(x)}" for x in sp["skipped"][:SHOWN_SKIPPED]]
            if len(sp["skipped"]) > SHOWN_SKIPPED:  # a sidecar per photo (Google Takeout's .json)
                listed = os.path.join(prepared.version_dir(name, data_dir), prepared.INFO_FILE)
                lines.append(f"    ... and {len(sp['skipped']) - SHOWN_SKIPPED} more, all listed "
                             f"in {listed}")
    if info["ignored"]:
        lines.append(f"  ignored {len(info['ignored'])} file(s) outside class folders: "
                     f"{formats.shown(', '.join(info['ignored'][:5]))}"
                     f"{' ...' if len(info['ignored']) > 5 else ''}")
    copies = info.get("copies") or []
    if copies:
        labels = sum(c["label"] != c["copy_label"] for c in copies)
        c = copies[0]
        kinds = [f"{labels} under another class (trained with both labels)"] if labels else []
        kinds += ([f"{len(copies) - labels} in another split (evaluated on an image trained on)"]
                  if len(copies) > labels else [])
        lines.append(
            f"  note: {len(copies)} image(s) are byte-identical to an earlier one: "
            f"{', '.join(kinds)}; e.g. {formats.shown(c['file'])} ({c['split']}, {c['label']}) = "
            f"{formats.shown(c['copy_of'])} ({c['copy_split']}, {c['copy_label']}); all in "
            f"prepare.json ('copies')")
    if info.get("held_out"):
        h = info["held_out"]
        lines.append(f"  held out {h['fraction']:g} of each class as '{h['split']}' (seed {h['seed']})")
    st = info["stats"]
    lines.append(f"  train per-channel mean {st['mean']}, std {st['std']} (data.normalize=zscore)")
    # No held-out split (--val_fraction=0): the command evaluates on train, so that it runs.
    eval_flag = "" if info["eval_split"] else " --config.data.eval_split=train"
    why = ("--val_fraction=0" if not val_fraction else
           "the source has only a train split; add a val/ or test/ folder of the same classes")
    lines.append(f"  eval split: {info['eval_split']}" if info["eval_split"] else
                 f"  eval split: none ({why}): the command below evaluates on 'train', "
                 "which measures fit, not accuracy on new images")
    # Fewer train images than the config's batch: not one step per epoch, so the run would stop;
    # the command then sets the batch that fits.
    batch_flag = _batch_flag(info["splits"].get("train", {}).get("examples", 0))
    lines.append(f"train: python main.py --config={suggested_config(info)} --config.data.name={name} "
                 f"--config.data.data_dir={data_dir}{eval_flag}{batch_flag} --workdir=runs/{name}")
    return "\n".join(lines)


def _batch_flag(train_examples: int) -> str:
    """`` --config.batch_size=B`` (the largest power of two <= the train examples) when the
    suggested configs' batch (configs/default.py's, also ``:small32``'s) is larger than the train
    split, else ''."""
    from configs import default  # pylint: disable=import-outside-toplevel
    if train_examples < 1 or train_examples >= default.get_config().batch_size:
        return ""
    return f" --config.batch_size={1 << (train_examples.bit_length() - 1)}"


SMALL_IMAGE_SIDE = 64  # train images no larger than this: the small-image preset


def suggested_config(info: dict[str, Any]) -> str:
    """``configs/vit_ln.py:small32`` (under five minutes on an idle 2-core CPU, docs/data.md) when every
    train image is at most SMALL_IMAGE_SIDE px on both sides, else the README's method config."""
    largest = (info["splits"].get("train") or {}).get("max_size") or [1 << 30]
    return ("configs/vit_ln.py:small32" if max(largest) <= SMALL_IMAGE_SIDE
            else "configs/vit_dtn.py")


def _is_write_error(e: BaseException) -> bool:
    """An OSError, or tfds's RuntimeError around one (its message names the OS error)."""
    seen = e
    while seen is not None:
        if isinstance(seen, OSError):
            return True
        seen = seen.__cause__ or seen.__context__
    return "No space left on device" in str(e) or "[Errno " in str(e)


def _write_failed(data_dir: str, e: BaseException) -> PrepareError:
    """A --data_dir that cannot be written (a full disk): one line, exit 2; the partial folder is
    already removed."""
    why = " ".join(str(e).split())
    if len(why) > 300:
        why = why[:150] + " ... " + why[-150:]
    hint = ("free disk space" if "No space left on device" in why else "fix its permissions")
    return PrepareError(f"cannot write the dataset in --data_dir {data_dir} ({type(e).__name__}: "
                        f"{why}); nothing was prepared: {hint} or pass another --data_dir")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    from normvit_jax import logs, tool_flags
    logs.quiet_library_logs()
    p = tool_flags.Parser("python -m normvit_jax.data.prepare", __doc__)
    p.add_argument("--src", required=True, help="folder, .npz/.npy, CIFAR archive or IDX folder")
    p.add_argument("--name", required=True, help="dataset name (lower case, digits, _), e.g. "
                   "my_flowers; train with --config.data.name=NAME")
    p.add_argument("--data_dir", default=None, help="tfds data dir to write in (default: "
                   "$TFDS_DATA_DIR or ~/tensorflow_datasets)")
    p.add_argument("--format", default=None, choices=list(formats.FORMATS),
                   help="source format (default: detected from --src)")
    p.add_argument("--strict", action="store_true", help="refuse unreadable images instead of "
                   "skipping them")
    p.add_argument("--val_fraction", type=float, default=0.1, help="single class tree or single "
                   "images/labels pool: fraction of each class held out as 'validation' (0: none)")
    p.add_argument("--seed", type=int, default=0, help="seed of the held-out choice")
    p.add_argument("--overwrite", action="store_true", help="replace a dataset already prepared "
                   "under this name (the old one stays readable until the new one is complete)")
    p.add_argument("--workers", type=int, default=None, help="decode threads (default: cores)")
    args = p.parse_args(argv)
    try:
        if not 0.0 <= args.val_fraction < 1.0:
            raise PrepareError(f"--val_fraction={args.val_fraction}; accepted: a number in [0, 1)")
        if args.workers is not None and args.workers < 1:  # was a traceback from the thread pool
            raise PrepareError(f"--workers={args.workers}; accepted: an integer >= 1 (leave it "
                               "out for one per core)")
        check_name(args.name)
        data_dir = os.path.abspath(args.data_dir or prepared.default_data_dir())
        final = os.path.join(data_dir, args.name)
        if os.path.exists(final) and not prepared.is_prepared(args.name, data_dir):
            # never replaced, --overwrite or not: it may be the user's files (even --src)
            raise PrepareError(f"{final} exists and is not a prepared dataset; choose another "
                               "--name or --data_dir (--overwrite replaces only a dataset)")
        if os.path.exists(final) and not args.overwrite:
            raise PrepareError(f"{final} is already prepared; pass --overwrite to replace it, or "
                               "choose another --name")
        try:  # before the work, not a traceback at its end
            tool_flags.check_output("data_dir", data_dir, folder=True)
        except ValueError as e:
            raise PrepareError(str(e)) from None
        t0 = time.perf_counter()
        fmt, parsed, held = parse_source(args.src, args.format, args.val_fraction, args.seed)
        extra = dict(format=fmt, source=os.path.abspath(args.src), held_out=held)
        workers = args.workers or min(32, len(os.sched_getaffinity(0)))
        info = write(parsed, args.name, data_dir, strict=args.strict, workers=workers, extra=extra)
    except PrepareError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    except KeyboardInterrupt:
        print(f"\ninterrupted: {args.name!r} is not prepared (the partial files are removed by the "
              f"next run of the same command)", file=sys.stderr)
        sys.exit(130)
    print(summary(info, args.name, data_dir, time.perf_counter() - t0, args.val_fraction))
    return info


if __name__ == "__main__":
    from normvit_jax import logs as _logs  # absl's log format, as main.py's
    _logs.absl_format()
    main()
