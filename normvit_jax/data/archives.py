"""Readers of the classic archive formats ``prepare`` accepts (docs/data.md): CIFAR-10/100
(binary and python versions, in a .tar.gz or a folder) and MNIST-family IDX files. Each returns a
``formats.Parsed``; bad input raises ``formats.PrepareError`` with one line naming the file.
"""
from __future__ import annotations

import gzip
import io
import os
import pickle
import tarfile
from typing import Callable

import numpy as np

from normvit_jax.data.formats import (IDX_NAME, Parsed, PrepareError, array_split, check_labels,
                                      class_names_file, numbered, visible)

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
            # one line: tarfile lists the reason of each compression it tried on lines of their own
            raise PrepareError(f"{src}: not a readable tar archive ({' '.join(str(e).split())})") \
                from None
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
    for e in visible(src) if os.path.isdir(src) else []:
        mt = IDX_NAME.match(e)
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
    return Parsed(class_names_file(src, top) or numbered(labels), splits)
