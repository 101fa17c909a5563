"""The source formats ``prepare`` accepts (docs/data.md): their common types, the readers of image
folders and .npz/.npy arrays, and ``detect``; the CIFAR-10/100 and IDX readers are in archives.py.
Each reader returns a ``Parsed``: class names and, per split, the labels and a
``load(i) -> (bytes to store, RGB uint8)`` function.

Bad input raises ``PrepareError`` with one line naming the file; only image files that cannot be
decoded raise ``images.BadImageError`` from ``load`` (prepare skips or refuses them).
"""
from __future__ import annotations

import dataclasses
import os
import re
import unicodedata
from typing import Callable

import numpy as np

from normvit_jax.data import images

EVAL_SPLIT_NAMES = ("validation", "val", "test")  # preferred eval split, first found
FORMATS = ("folder", "arrays", "cifar", "idx")
# MNIST-family IDX file names (detect here, read_idx in archives.py)
IDX_NAME = re.compile(r"(?:^|.*[-_.])(train|t10k|test)-(images|labels)[-.]idx([13])-ubyte(\.gz)?$")


class PrepareError(Exception):
    """Input prepare refuses; the message names the file and what is accepted."""


@dataclasses.dataclass
class Split:
    labels: np.ndarray                              # int64 (N,)
    names: list[str]                                # file path, or "file[i]", per example
    load: Callable[[int], tuple[bytes, np.ndarray]]  # i -> (stored bytes, uint8 (H, W, 3))


@dataclasses.dataclass
class Parsed:
    classes: list[str]
    splits: dict[str, Split]
    ignored: list[str] = dataclasses.field(default_factory=list)  # files not read, for the summary


def array_split(x: np.ndarray, labels: np.ndarray, where: str) -> Split:
    rgb = images.array_to_rgb(x, where)
    return Split(np.asarray(labels, np.int64), [f"{where}[{i}]" for i in range(len(labels))],
                 lambda i: (images.encode_png(rgb[i]), rgb[i]))


def subset(s: Split, idx: np.ndarray) -> Split:
    idx = [int(i) for i in idx]
    return Split(s.labels[idx], [s.names[i] for i in idx], lambda j: s.load(idx[j]))


def hold_out(s: Split, fraction: float, seed: int, eligible: np.ndarray | None = None
             ) -> tuple[Split, Split]:
    """(train, held-out): round(fraction * n_c) examples of each class c, at most n_c - 1 (a class
    held out whole was written with no train example: never learned, yet evaluated), chosen by a
    permutation of that class's examples (in source order) drawn from ``default_rng([seed, c])``.
    ``eligible`` (bool per example; default all): only these are counted in n_c and held out, the
    rest stay in train (a folder's files that are no image: skipped there, and named)."""
    train, held = [], []
    ok = np.ones(len(s.labels), bool) if eligible is None else np.asarray(eligible, bool)
    train.extend(np.flatnonzero(~ok).tolist())
    for c in np.unique(s.labels):
        members = np.flatnonzero((s.labels == c) & ok)
        if not len(members):
            continue
        perm = np.random.default_rng([seed, int(c)]).permutation(len(members))
        k = min(int(round(fraction * len(members))), len(members) - 1)
        held.extend(members[perm[:k]].tolist())
        train.extend(members[perm[k:]].tolist())
    return subset(s, np.sort(train)), subset(s, np.sort(held))


def check_labels(p: Parsed) -> None:
    for name, s in p.splits.items():
        bad = (s.labels < 0) | (s.labels >= len(p.classes))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise PrepareError(f"{s.names[i]}: label {int(s.labels[i])} of split {name!r} is out "
                               f"of range; accepted: 0..{len(p.classes) - 1} ({len(p.classes)} "
                               f"classes)")


def class_names_file(directory: str, num: int | None) -> list[str] | None:
    """Names from ``classes.txt`` (one per line) in ``directory``, if there is one."""
    path = os.path.join(directory, "classes.txt")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        names = [ln.strip() for ln in f if ln.strip()]
    if num is not None and len(names) < num:
        raise PrepareError(f"{path}: {len(names)} names but labels go up to {num - 1}")
    return names


def numbered(labels: list[np.ndarray]) -> list[str]:
    """Class names "0".."K-1" for labels up to K-1, where no names are given."""
    top = max((int(x.max()) for x in labels if x.size), default=-1)
    return [str(i) for i in range(top + 1)]


# ---------------------------------------------------------------- folders of images
def shown(path: str) -> str:
    """``path`` printable in any locale: bytes of a file name that are not UTF-8 (which Python
    holds as surrogates, and a UTF-8 terminal refused to print: a traceback) as ``\\xe9``."""
    return path.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


# Folders a NAS adds beside photos: Synology's @eaDir holds 3-5 thumbnails of every photo, which
# were read as more images of the class, each in train or validation as it fell (a leak). A zip
# made on a Mac unzips with a __MACOSX folder of resource forks (._*) beside the class folders,
# which stopped prepare as an empty class folder.
NAS_FOLDERS = ("@eaDir", "__MACOSX")
# Files Windows Explorer writes beside photos (thumbnail caches, folder settings); lower case, as
# Windows matches names. Their .DS_Store is hidden by its dot, these are not: each was an
# "unreadable image" in every folder, drawn into the held-out share like a photo, and --strict
# refused the whole folder for one.
WINDOWS_FILES = ("thumbs.db", "ehthumbs.db", "ehthumbs_vista.db", "desktop.ini")


def is_hidden(name: str) -> bool:
    """A name the folder readers skip: hidden (``.*``: .DS_Store, ._x.jpg, .git), NAS_FOLDERS
    (Synology's @eaDir, a Mac zip's __MACOSX) or WINDOWS_FILES."""
    return name.startswith(".") or name in NAS_FOLDERS or name.lower() in WINDOWS_FILES


def visible(d: str) -> list[str]:
    """The entries of folder ``d`` that are not hidden, sorted."""
    return sorted(e for e in os.listdir(d) if not is_hidden(e))


def walk_files(top: str) -> list[str]:
    """The files under folder ``top`` in sorted order, hidden ones (``is_hidden``) skipped. Links
    to folders are followed, as torchvision's ImageFolder does (os.walk's default dropped them
    silently), each real folder once; a link to ``top`` or a folder above it (a loop, which would
    bring in the other classes' files) is not followed. Raises OSError for a folder that cannot be
    listed (os.walk's default skipped it silently)."""
    out: list[str] = []
    top_real = os.path.realpath(top)
    seen: set[str] = set()

    def fail(e: OSError) -> None:
        raise e
    for root, dirs, files in os.walk(top, onerror=fail, followlinks=True):
        real = os.path.realpath(root)
        if real in seen or (root != top and (top_real + os.sep).startswith(real + os.sep)):
            dirs[:] = []
            continue
        seen.add(real)
        dirs[:] = sorted(x for x in dirs if not is_hidden(x))
        out.extend(os.path.join(root, f) for f in sorted(files) if not is_hidden(f))
    return out


# Photo extensions taken as images without opening the file (a header read per file is 0.05-0.4
# ms: minutes over an ImageNet-sized folder); any other name is judged by its header
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")


def is_image_file(path: str) -> bool:
    """Whether ``path`` is an image: a photo's extension (IMAGE_EXTENSIONS, any case), else PIL
    recognises its header (the pixels are not decoded)."""
    if path.lower().endswith(IMAGE_EXTENSIONS):
        return True
    from PIL import Image
    try:
        with Image.open(path):
            return True
    except Exception:  # noqa: BLE001  (not an image, unreadable, a broken link, too large)
        return False


def _class_files(class_dir: str) -> list[str]:
    try:
        out = walk_files(class_dir)
    except OSError as e:
        raise PrepareError(f"{e.filename or class_dir}: cannot be listed ({e.strerror or e})"
                           ) from None
    if not out:
        raise PrepareError(f"{class_dir}: empty class folder; put images in it or remove it")
    return out


def _load_path(path: str) -> tuple[bytes, np.ndarray]:
    try:
        data = images.read_file(path)
    except OSError as e:  # a broken link, no permission: unreadable like a corrupt file (skipped)
        if os.path.islink(path) and not os.path.exists(path):
            raise images.BadImageError(f"a broken symbolic link to {os.readlink(path)}") from None
        raise images.BadImageError(f"cannot be read ({type(e).__name__}: {e.strerror or e})"
                                   ) from None
    return images.load_file(data, check_tf=True)  # stored as it is: training's decoder too


def _tree(d: str, ignored: list[str]) -> dict[str, list[str]]:
    classes = {}
    for e in visible(d):
        p = os.path.join(d, e)
        real, d_real = os.path.realpath(p), os.path.realpath(d)
        if os.path.isdir(p) and not (d_real + os.sep).startswith(real + os.sep):
            classes[e] = _class_files(p)
        else:
            ignored.append(p)
    if not classes:
        raise PrepareError(f"{d}: no class folders; expected {d}/<class>/<image>")
    return classes


# Folder names that mean a split, not a class, in downloaded datasets ('Train'/'Test',
# 'training_set'/'test_set', ...): only lower-case train, val, validation and test are splits here.
_SPLIT_LIKE = re.compile(r"(train|training|test|testing|val|valid|validation|eval|dev)"
                         r"(_?set)?", re.IGNORECASE)


def _refuse_split_like(src: str, subdirs: list[str]) -> None:
    """A single tree whose every class folder is named like a split and holds folders ('Train/cat',
    'Test/cat') was read as the classes 'Test' and 'Train': a model that tells the two folders
    apart, trained without a word."""
    if subdirs and all(_SPLIT_LIKE.fullmatch(d) for d in subdirs) and any(
            os.path.isdir(os.path.join(src, d, e)) for d in subdirs
            for e in visible(os.path.join(src, d))):
        names = ", ".join(repr(d) for d in subdirs)
        raise PrepareError(f"{src}: the folders {names} look like splits, not classes; name them "
                           "train/ and val/, validation/ or test/ (lower case), each holding one "
                           "folder per class, or point --src at one of them")


def read_folder(src: str) -> tuple[Parsed, bool]:
    """(parsed, single_tree): ``src/<split>/<class>/...`` with a ``train`` split, or a single
    ``src/<class>/...`` tree (one 'train' split; ``prepare`` then holds out a fraction)."""
    ignored: list[str] = []
    subdirs = [e for e in visible(src) if os.path.isdir(os.path.join(src, e))]
    split_layout = "train" in subdirs
    if split_layout:
        others = [e for e in subdirs if e != "train"]
        extra = [e for e in others if e not in EVAL_SPLIT_NAMES]
        if extra:
            raise PrepareError(f"{os.path.join(src, extra[0])}: unexpected folder next to 'train';"
                               f" accepted splits: train, {', '.join(EVAL_SPLIT_NAMES)}")
        ignored += [os.path.join(src, e) for e in visible(src) if e not in subdirs]
        trees = {s: _tree(os.path.join(src, s), ignored) for s in ["train"] + others}
    else:
        _refuse_split_like(src, subdirs)
        trees = {"train": _tree(src, ignored)}
    classes = sorted(trees["train"])
    for c in classes:  # the dataset stores the names as UTF-8 text: tfds's traceback at the end
        try:
            c.encode("utf-8")
        except UnicodeEncodeError:
            raise PrepareError(
                f"{shown(os.path.join(src, 'train' if split_layout else '', c))}: the class "
                "folder's name is not valid UTF-8 (made on another system, e.g. a zip from old "
                "Windows); rename it (convmv -f cp1252 -t utf8 -r DIR fixes every name)") from None
    # Classes match across splits by their NFC form: a name typed on a Mac and copied (zip,
    # rsync) arrives decomposed (NFD: 'e' + U+0301 for 'é'), prints the same, and val/café was
    # refused as "class 'café' of split 'val' is not a class of train"
    index: dict[str, int] = {}
    for i, c in enumerate(classes):
        first = index.setdefault(unicodedata.normalize("NFC", c), i)
        if first != i:
            where = os.path.join(src, "train" if split_layout else "")
            raise PrepareError(
                f"{shown(os.path.join(where, classes[first]))} and {shown(os.path.join(where, c))}:"
                " one class name written in two Unicode forms (composed and decomposed, as a Mac "
                "writes it); merge the two folders")
    splits = {}
    for s, tree in trees.items():
        key = {c: unicodedata.normalize("NFC", c) for c in tree}
        missing = [c for c in tree if key[c] not in index]
        if missing:
            raise PrepareError(f"{os.path.join(src, s, missing[0])}: class {missing[0]!r} of split"
                               f" {s!r} is not a class of train")
        paths = [p for c in sorted(tree) for p in tree[c]]
        labels = np.array([index[key[c]] for c in sorted(tree) for _ in tree[c]], np.int64)
        splits[s] = Split(labels, paths, lambda i, paths=paths: _load_path(paths[i]))
    return Parsed(classes, splits, ignored), not split_layout


# ---------------------------------------------------------------- .npz / .npy arrays
def _is_npy_or_npz(path: str) -> bool:
    """A .npy header or a zip (.npz): numpy takes any other file for a pickle."""
    with open(path, "rb") as f:
        return f.read(6).startswith((b"\x93NUMPY", b"PK\x03\x04"))


def _np_load(path: str):
    try:
        return np.load(path, allow_pickle=False)
    except ValueError as e:
        if "allow_pickle" in str(e) and not _is_npy_or_npz(path):
            raise PrepareError(f"{path}: not an .npz (zip) or .npy file; write the arrays with "
                               "numpy.savez or numpy.save") from None
        if "allow_pickle" in str(e):
            raise PrepareError(f"{path}: holds pickled Python objects, which are never loaded "
                               f"(allow_pickle=False); save plain numeric arrays") from None
        raise PrepareError(f"{path}: not a readable .npy/.npz file ({e})") from None
    except Exception as e:  # noqa: BLE001  (zip/format errors)
        raise PrepareError(f"{path}: not a readable .npy/.npz file ({type(e).__name__}: {e})") \
            from None


def _get(z, key: str, path: str) -> np.ndarray:
    try:
        return z[key]
    except ValueError as e:
        if "allow_pickle" in str(e):
            raise PrepareError(f"{path}: key {key!r} holds pickled Python objects, which are never"
                               f" loaded (allow_pickle=False); save plain numeric arrays") from None
        raise PrepareError(f"{path}: key {key!r} cannot be read ({e})") from None


def _pairs_npz(path: str) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], list[str] | None]:
    z = _np_load(path)
    if not hasattr(z, "files"):
        raise PrepareError(f"{path}: a single .npy array has no labels; use an .npz with 'images'"
                           f" and 'labels' (or <split>_images/<split>_labels, x_train/y_train)")
    keys = set(z.files)
    pairs: dict[str, tuple[str, str]] = {}
    if {"images", "labels"} <= keys:
        pairs["train"] = ("images", "labels")
    for k in sorted(keys):
        m = re.fullmatch(r"(\w+?)_images", k) or re.fullmatch(r"x_(\w+)", k)
        if m:
            lk = f"{m.group(1)}_labels" if k.endswith("_images") else f"y_{m.group(1)}"
            if lk not in keys:
                raise PrepareError(f"{path}: {k!r} has no matching {lk!r}")
            pairs[m.group(1)] = (k, lk)
    if not pairs:
        raise PrepareError(f"{path}: keys {sorted(keys)}; accepted: 'images' + 'labels', "
                           f"'<split>_images' + '<split>_labels', or 'x_<split>' + 'y_<split>'")
    names = None
    if "class_names" in keys:
        names = [str(s) for s in _get(z, "class_names", path).tolist()]
    return {s: (_get(z, a, path), _get(z, b, path)) for s, (a, b) in pairs.items()}, names


def read_arrays(src: str) -> tuple[Parsed, bool]:
    """An .npz file, or a folder of ``<split>.npz`` files / ``<split>_images.npy`` +
    ``<split>_labels.npy`` pairs. (parsed, single_pool: only one unnamed 'images'/'labels')."""
    names = None
    if os.path.isfile(src):
        data, names = _pairs_npz(src)
        where = {s: src for s in data}
        single = list(data) == ["train"] and "images" in _np_load(src).files
        folder = os.path.dirname(src)
    else:
        data, where, folder, single = {}, {}, src, False
        for e in visible(src):
            p = os.path.join(src, e)
            if e.endswith(".npz"):
                pairs, n = _pairs_npz(p)
                if len(pairs) != 1:
                    raise PrepareError(f"{p}: a <split>.npz holds one split ('images' + "
                                       f"'labels'); found {sorted(pairs)}")
                data[e[:-4]], where[e[:-4]] = next(iter(pairs.values())), p
                names = names or n
            elif e.endswith("_images.npy"):
                s = e[: -len("_images.npy")]
                lp = os.path.join(src, f"{s}_labels.npy")
                if not os.path.isfile(lp):
                    raise PrepareError(f"{p}: no matching {lp}")
                data[s], where[s] = (_np_load(p), _np_load(lp)), p
        if not data:
            raise PrepareError(f"{src}: no <split>.npz or <split>_images.npy files")
        if "train" not in data:
            raise PrepareError(f"{src}: no train split (train.npz or train_images.npy); found "
                               f"{sorted(data)}")
    splits = {}
    for s, (x, y) in data.items():
        y = np.asarray(y)
        if y.ndim != 1 or not (np.issubdtype(y.dtype, np.integer) or y.dtype == bool):
            raise PrepareError(f"{where[s]}: labels of split {s!r} have shape {y.shape} and dtype "
                               f"{y.dtype}; accepted: integers of shape (N,)")
        if len(x) != len(y):
            raise PrepareError(f"{where[s]}: split {s!r} has {len(x)} images but {len(y)} labels")
        try:
            splits[s] = array_split(x, y, where[s])
        except ValueError as e:
            raise PrepareError(str(e)) from None
    labels = [sp.labels for sp in splits.values()]
    top = max((int(x.max()) + 1 for x in labels if x.size), default=0)
    names = names or class_names_file(folder, top) or numbered(labels)
    return Parsed(names, splits), single


def detect(src: str) -> str:
    """The format of ``src``, from its name and contents; raises PrepareError if none fits."""
    if not os.path.exists(src):
        raise PrepareError(f"--src={src}: no such file or folder")
    base = os.path.basename(src.rstrip("/")).lower()
    if os.path.isfile(src):
        if base.endswith((".npz", ".npy")):
            return "arrays"
        if ".tar" in base or base.endswith(".tgz"):
            return "cifar"
        raise PrepareError(f"--src={src}: a file of unknown format; accepted files: .npz, .npy, "
                           f"CIFAR .tar.gz archives (or pass --format)")
    entries = visible(src)
    if any(IDX_NAME.match(e) for e in entries):
        return "idx"
    if any(e.endswith((".npz", "_images.npy")) for e in entries):
        return "arrays"
    cifar = ("data_batch_1", "data_batch_1.bin", "train.bin", "test_batch", "test_batch.bin",
             "meta", "batches.meta", "batches.meta.txt", "fine_label_names.txt")
    if base.startswith("cifar-") or any(e in cifar or e.startswith("cifar-") for e in entries):
        return "cifar"
    return "folder"
