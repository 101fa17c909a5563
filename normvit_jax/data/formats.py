"""Readers of the source formats ``prepare`` accepts (docs/data.md): image folders, .npz/.npy
arrays, CIFAR-10/100 archives (binary and python), IDX files. Each returns a ``Parsed``: class
names and, per split, the labels and a ``load(i) -> (bytes to store, RGB uint8)`` function.

Bad input raises ``PrepareError`` with one line naming the file; only image files that cannot be
decoded raise ``images.BadImageError`` from ``load`` (prepare skips or refuses them).
"""
from __future__ import annotations

import dataclasses
import gzip
import io
import os
import pickle
import re
import tarfile
from typing import Callable

import numpy as np

from normvit_jax.data import images

EVAL_SPLIT_NAMES = ("validation", "val", "test")  # preferred eval split, first found
FORMATS = ("folder", "arrays", "cifar", "idx")


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


def hold_out(s: Split, fraction: float, seed: int) -> tuple[Split, Split]:
    """(train, held-out): round(fraction * n_c) examples of each class c, chosen by a permutation
    of that class's examples (in source order) drawn from ``default_rng([seed, c])``."""
    train, held = [], []
    for c in np.unique(s.labels):
        members = np.flatnonzero(s.labels == c)
        perm = np.random.default_rng([seed, int(c)]).permutation(len(members))
        k = int(round(fraction * len(members)))
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


def _numbered(labels: list[np.ndarray]) -> list[str]:
    top = max((int(x.max()) for x in labels if x.size), default=-1)
    return [str(i) for i in range(top + 1)]


# ---------------------------------------------------------------- folders of images
def _visible(d: str) -> list[str]:
    return sorted(e for e in os.listdir(d) if not e.startswith("."))


def _class_files(class_dir: str) -> list[str]:
    out = []
    for root, dirs, files in os.walk(class_dir):
        dirs[:] = sorted(x for x in dirs if not x.startswith("."))
        out.extend(os.path.join(root, f) for f in sorted(files) if not f.startswith("."))
    if not out:
        raise PrepareError(f"{class_dir}: empty class folder; put images in it or remove it")
    return out


def _load_path(path: str) -> tuple[bytes, np.ndarray]:
    with open(path, "rb") as f:
        return images.load_file(f.read())


def _tree(d: str, ignored: list[str]) -> dict[str, list[str]]:
    classes = {}
    for e in _visible(d):
        p = os.path.join(d, e)
        if os.path.isdir(p):
            classes[e] = _class_files(p)
        else:
            ignored.append(p)
    if not classes:
        raise PrepareError(f"{d}: no class folders; expected {d}/<class>/<image>")
    return classes


def read_folder(src: str) -> tuple[Parsed, bool]:
    """(parsed, single_tree): ``src/<split>/<class>/...`` with a ``train`` split, or a single
    ``src/<class>/...`` tree (one 'train' split; ``prepare`` then holds out a fraction)."""
    ignored: list[str] = []
    subdirs = [e for e in _visible(src) if os.path.isdir(os.path.join(src, e))]
    split_layout = "train" in subdirs
    if split_layout:
        others = [e for e in subdirs if e != "train"]
        extra = [e for e in others if e not in EVAL_SPLIT_NAMES]
        if extra:
            raise PrepareError(f"{os.path.join(src, extra[0])}: unexpected folder next to 'train';"
                               f" accepted splits: train, {', '.join(EVAL_SPLIT_NAMES)}")
        ignored += [os.path.join(src, e) for e in _visible(src) if e not in subdirs]
        trees = {s: _tree(os.path.join(src, s), ignored) for s in ["train"] + others}
    else:
        trees = {"train": _tree(src, ignored)}
    classes = sorted(trees["train"])
    index = {c: i for i, c in enumerate(classes)}
    splits = {}
    for s, tree in trees.items():
        missing = [c for c in tree if c not in index]
        if missing:
            raise PrepareError(f"{os.path.join(src, s, missing[0])}: class {missing[0]!r} of split"
                               f" {s!r} is not a class of train")
        paths = [p for c in sorted(tree) for p in tree[c]]
        labels = np.array([index[c] for c in sorted(tree) for _ in tree[c]], np.int64)
        splits[s] = Split(labels, paths, lambda i, paths=paths: _load_path(paths[i]))
    return Parsed(classes, splits, ignored), not split_layout


# ---------------------------------------------------------------- .npz / .npy arrays
def _np_load(path: str):
    try:
        return np.load(path, allow_pickle=False)
    except ValueError as e:
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
        for e in _visible(src):
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
    names = names or class_names_file(folder, top) or _numbered(labels)
    return Parsed(names, splits), single


# ---------------------------------------------------------------- CIFAR-10/100 archives
_CIFAR10_NAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship",
                  "truck"]
_PICKLE_ALLOWED = {  # what numpy arrays in the python CIFAR files are pickled as
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode"),
}


class _CifarUnpickler(pickle.Unpickler):
    """Admits dicts, lists, strings, bytes and numpy arrays; any other global is refused."""

    def __init__(self, data: bytes, where: str):
        super().__init__(io.BytesIO(data), encoding="latin1")
        self.where = where

    def find_class(self, module: str, name: str):
        if (module, name) not in _PICKLE_ALLOWED:
            raise PrepareError(
                f"{self.where}: the pickle refers to {module}.{name}, which is not a type of the "
                f"CIFAR python files; not loaded. Use the binary version (cifar-10-binary.tar.gz"
                f" / cifar-100-binary.tar.gz) instead")
        return super().find_class(module, name)


def _unpickle(data: bytes, where: str) -> dict:
    try:
        d = _CifarUnpickler(data, where).load()
    except PrepareError:
        raise
    except Exception as e:  # noqa: BLE001
        raise PrepareError(f"{where}: not a CIFAR python batch ({type(e).__name__}: {e})") from None
    if not isinstance(d, dict):
        raise PrepareError(f"{where}: not a CIFAR python batch (a {type(d).__name__}, not a dict)")
    return {k.decode("latin1") if isinstance(k, bytes) else k: v for k, v in d.items()}


def _members(src: str) -> dict[str, tuple[str, Callable[[], bytes]]]:
    """basename -> (display path, reader), from a .tar(.gz) archive or a folder tree."""
    out: dict[str, tuple[str, Callable[[], bytes]]] = {}
    if os.path.isfile(src):
        try:
            tf = tarfile.open(src)
        except (tarfile.TarError, OSError) as e:
            raise PrepareError(f"{src}: not a readable tar archive ({e})") from None
        for m in tf.getmembers():
            if m.isfile():
                out[os.path.basename(m.name)] = (
                    f"{src}:{m.name}", lambda m=m: tf.extractfile(m).read())
        return out
    for root, _, files in os.walk(src):
        for f in files:
            p = os.path.join(root, f)
            out[f] = (p, lambda p=p: open(p, "rb").read())
    return out


def _cifar_binary(data: bytes, where: str, label_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    rec = label_bytes + 3072
    if not data or len(data) % rec:
        raise PrepareError(f"{where}: {len(data)} bytes is not a whole number of {rec}-byte CIFAR "
                           f"records")
    a = np.frombuffer(data, np.uint8).reshape(-1, rec)
    return a[:, label_bytes:].reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1), \
        a[:, label_bytes - 1].astype(np.int64)  # CIFAR-100: (coarse, fine): the fine label


def _cifar_python(d: dict, where: str, key: str) -> tuple[np.ndarray, np.ndarray]:
    if "data" not in d or key not in d:
        raise PrepareError(f"{where}: no 'data'/{key!r} entries; keys {sorted(map(str, d))}")
    x = np.asarray(d["data"])
    if x.dtype != np.uint8 or x.ndim != 2 or x.shape[1] != 3072:
        raise PrepareError(f"{where}: 'data' has shape {x.shape} {x.dtype}; expected (N, 3072) "
                           f"uint8")
    y = np.asarray(d[key], np.int64)
    if len(y) != len(x):
        raise PrepareError(f"{where}: {len(x)} images but {len(y)} labels")
    return x.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1), y


def read_cifar(src: str) -> Parsed:
    m = _members(src)
    layouts = [  # (train members, test member, label bytes | python key, names member, names key)
        ([f"data_batch_{i}.bin" for i in range(1, 6)], "test_batch.bin", 1, "batches.meta.txt",
         None, 10),
        (["train.bin"], "test.bin", 2, "fine_label_names.txt", None, 100),
        ([f"data_batch_{i}" for i in range(1, 6)], "test_batch", "labels", "batches.meta",
         "label_names", 10),
        (["train"], "test", "fine_labels", "meta", "fine_label_names", 100),
    ]
    for train_names, test_name, how, meta, meta_key, k in layouts:
        have = [t for t in train_names if t in m]
        if not have or test_name not in m:
            continue
        splits = {}
        for s, members in (("train", have), ("test", [test_name])):
            xs, ys = [], []
            for name in members:
                where, read = m[name]
                if isinstance(how, int):
                    x, y = _cifar_binary(read(), where, how)
                else:
                    x, y = _cifar_python(_unpickle(read(), where), where, how)
                xs.append(x), ys.append(y)
            splits[s] = array_split(np.concatenate(xs), np.concatenate(ys), m[members[0]][0])
        names = None
        if meta in m:
            where, read = m[meta]
            if meta_key is None:
                names = [ln.strip() for ln in read().decode("utf-8").splitlines() if ln.strip()]
            else:
                names = [str(n) for n in _unpickle(read(), where).get(meta_key, [])]
        if not names or len(names) != k:
            names = _CIFAR10_NAMES if k == 10 else [str(i) for i in range(k)]
        p = Parsed(names, splits)
        check_labels(p)
        return p
    raise PrepareError(f"{src}: no CIFAR files found; expected data_batch_*.bin + test_batch.bin "
                       f"(CIFAR-10 binary), train.bin + test.bin (CIFAR-100 binary), data_batch_* "
                       f"+ test_batch or train + test (python versions), in a .tar.gz or folder")


# ---------------------------------------------------------------- IDX (MNIST family)
_IDX_NAME = re.compile(r"(?:^|.*[-_.])(train|t10k|test)-(images|labels)[-.]idx([13])-ubyte(\.gz)?$")


def read_idx_file(path: str) -> np.ndarray:
    """An IDX file (gzip or not) of unsigned bytes -> its array."""
    try:
        with open(path, "rb") as f:
            data = f.read()
        if data[:2] == b"\x1f\x8b":
            data = gzip.decompress(data)
    except (OSError, EOFError) as e:
        raise PrepareError(f"{path}: cannot be read ({e})") from None
    if len(data) < 4 or data[:2] != b"\0\0" or data[2] != 0x08:
        raise PrepareError(f"{path}: not an IDX file of unsigned bytes (magic {data[:4].hex()}, "
                           f"expected 0000080N)")
    nd = data[3]
    dims = [int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(nd)]
    body = data[4 + 4 * nd:]
    if len(body) != int(np.prod(dims)):
        raise PrepareError(f"{path}: header says {dims} ({int(np.prod(dims))} bytes) but "
                           f"{len(body)} bytes follow")
    return np.frombuffer(body, np.uint8).reshape(dims)


def read_idx(src: str) -> Parsed:
    found: dict[str, dict[str, str]] = {}
    for e in _visible(src) if os.path.isdir(src) else []:
        mt = _IDX_NAME.match(e)
        if mt:
            split = "train" if mt.group(1) == "train" else "test"
            found.setdefault(split, {})[mt.group(2)] = os.path.join(src, e)
    if "train" not in found:
        raise PrepareError(f"{src}: no train-images-idx3-ubyte[.gz] / train-labels-idx1-ubyte[.gz]"
                           f" files")
    splits = {}
    for s, f in found.items():
        if set(f) != {"images", "labels"}:
            raise PrepareError(f"{src}: split {s!r} has only {sorted(f)}; need images and labels")
        x, y = read_idx_file(f["images"]), read_idx_file(f["labels"])
        if x.ndim != 3 or y.ndim != 1:
            raise PrepareError(f"{f['images']}: images of shape {x.shape} and labels of shape "
                               f"{y.shape}; expected (N, H, W) and (N,)")
        if len(x) != len(y):
            raise PrepareError(f"{f['labels']}: {len(y)} labels for {len(x)} images in "
                               f"{f['images']}")
        splits[s] = array_split(x, y.astype(np.int64), f["images"])
    labels = [sp.labels for sp in splits.values()]
    top = max(int(x.max()) + 1 for x in labels if x.size)
    return Parsed(class_names_file(src, top) or _numbered(labels), splits)


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
    entries = _visible(src)
    if any(_IDX_NAME.match(e) for e in entries):
        return "idx"
    if any(e.endswith((".npz", "_images.npy")) for e in entries):
        return "arrays"
    cifar = ("data_batch_1", "data_batch_1.bin", "train.bin", "test_batch", "test_batch.bin",
             "meta", "batches.meta", "batches.meta.txt", "fine_label_names.txt")
    if base.startswith("cifar-") or any(e in cifar or e.startswith("cifar-") for e in entries):
        return "cifar"
    return "folder"
