"""Opening tfds datasets offline: a fast 'is it prepared?' check, then in-memory or random access.
Where this tfds's version of a dataset is not prepared but another of the same major version is
(ImageNet 5.0.0, built by an older tfds), that one is read from its files (``_other_version``).

tfds's downloader retries for minutes without a network, so nothing here may reach it: every read
goes through ``open_builder``, which fails at once with what to do instead. Under
``tfds.testing.mock_data`` the builder is redirected to tfds's own metadata and reports itself
unprepared, so the check trusts the mock (detected by its patched ``DatasetBuilder.__init__``).
"""
from __future__ import annotations

import concurrent.futures as cf
import contextlib
import glob
import os
import tempfile
import threading
from typing import Any, Iterator

import numpy as np
from absl import logging

from normvit_jax import logs
from normvit_jax.data.errors import DatasetNotFoundError

_OFFLINE = ("Offline alternatives: the bundled digits data (`--config=configs/<method>.py:demo` or "
            "`--config.data.name=digits`), or tests under `tfds.testing.mock_data`.")


# The archives tfds cannot download (ImageNet's licence): tfds reads them from <data_dir>/downloads/manual.
MANUAL_FILES = {"imagenet2012": ("ILSVRC2012_img_train.tar", "ILSVRC2012_img_val.tar"),
                "imagenet2012_real": ("ILSVRC2012_img_val.tar",)}


_made = threading.local()  # .folders: the tmp*tfds folders this thread's block made
_patch_lock = threading.Lock()
_patch_users = 0
_original_mkdtemp = tempfile.mkdtemp


def _recording_mkdtemp(*args: Any, **kwargs: Any) -> str:
    """``tempfile.mkdtemp`` as it is; a ``tmp*tfds`` folder made inside a thread's
    ``no_stray_tmp_folders`` block is noted for that block."""
    path = _original_mkdtemp(*args, **kwargs)
    folders = getattr(_made, "folders", None)
    name = os.path.basename(os.fspath(path))
    if folders is not None and name.startswith("tmp") and name.endswith("tfds"):
        folders.append(path)
    return path


@contextlib.contextmanager
def no_stray_tmp_folders() -> Iterator[None]:
    """Removes the empty ``tmp*tfds`` folders this thread made during the block. tfds makes a
    builder for a dataset whose ``dataset_info.json`` is not there yet (the one ``prepare``
    writes, a registered dataset not prepared: ``open_builder``'s refusal) with
    ``DatasetInfo.initialize_from_bucket``, which calls ``tempfile.mkdtemp("tfds")`` before it
    looks for the dataset's info on GCS and leaves the folder, empty where there is none (always
    offline): thousands of them in /tmp after test runs. No tfds option skips it (``try_gcs`` is
    about the data, not the info), so during the block ``tempfile.mkdtemp`` notes the folders it
    makes in this thread (it still makes them as it did: other threads are not affected, and a
    folder another thread or process makes meanwhile, a concurrent tfds download's, is not noted)
    and those are removed afterwards, an empty one only (``os.rmdir``)."""
    global _patch_users
    outer = getattr(_made, "folders", None)
    _made.folders = []
    with _patch_lock:
        if _patch_users == 0:
            tempfile.mkdtemp = _recording_mkdtemp
        _patch_users += 1
    try:
        yield
    finally:
        with _patch_lock:
            _patch_users -= 1
            if _patch_users == 0:
                tempfile.mkdtemp = _original_mkdtemp
        folders, _made.folders = _made.folders, outer
        for d in folders:
            try:
                os.rmdir(d)
            except OSError:
                pass


def _tfds():
    logs.import_tensorflow_once()
    import tensorflow_datasets as tfds
    return tfds


def is_mocked() -> bool:
    """True inside ``tfds.testing.mock_data`` (it replaces ``DatasetBuilder.__init__``)."""
    init = _tfds().core.DatasetBuilder.__init__
    return getattr(init, "__module__", "").startswith("tensorflow_datasets.testing")


def _root(builder: Any, data_dir: str | None) -> str:
    if data_dir:
        return data_dir
    # data_path is <root>/<name>[/<config>]/<version>
    up = 2 + (getattr(builder, "builder_config", None) is not None)
    return os.fspath(builder.data_path.parents[up - 1])


def _other_version(builder: Any) -> tuple[Any | None, list[str]]:
    """(a read-only builder of the newest other prepared version of ``builder``'s dataset with the
    same major version, or None; the other prepared versions' names). An ImageNet that an older
    tfds built as 5.0.0 is the same data as this tfds's 5.1.0 but for its unlabelled 'test'
    split: it is read, not rebuilt (hours, and the archives again)."""
    tfds = _tfds()
    found = []
    try:
        for d in builder.data_path.parent.iterdir():
            try:
                version = tfds.core.Version(d.name)
            except ValueError:  # 'incomplete.*' folders of a build that stopped, other files
                continue
            if version != builder.version and (d / "dataset_info.json").exists():
                found.append((version, d))
    except Exception:  # noqa: BLE001  a best-effort look: a missing folder (on gs://, TF's
        return None, []  # NotFoundError, not an OSError) leaves the not-prepared message as it is
    same = [(v, d) for v, d in sorted(found, reverse=True) if v.major == builder.version.major]
    if same:
        return tfds.builder_from_directory(os.fspath(same[0][1])), []
    return None, [str(v) for v, _ in sorted(found, reverse=True)]


def open_builder(name: str, data_dir: str | None, *, random_access: bool) -> Any:
    """A tfds builder for prepared data; raises DatasetNotFoundError (no download) otherwise.

    ``random_access``: the data must be array_record (TFRecord files cannot be indexed).
    """
    tfds = _tfds()
    with no_stray_tmp_folders():  # not prepared: tfds's look for its info on GCS
        builder = tfds.builder(name, data_dir=data_dir)
    if is_mocked():
        return builder
    root = _root(builder, data_dir)
    # read by index: built as array_record at once (tfds's default, TFRecord, is refused below)
    build = (f"`tfds build {name} --data_dir={root}"
             f"{' --file_format=array_record' if random_access else ''}`")
    if name in MANUAL_FILES:
        how = (f"place {' and '.join(MANUAL_FILES[name])} in "
               f"{os.path.join(root, 'downloads', 'manual')} and run {build}")
        if name == "imagenet2012_real":
            how += " on a machine with network (it downloads the ReaL labels)"
    else:
        how = f"run {build} once on a machine with network"
    if not builder.is_prepared():
        other, others = _other_version(builder)
        if other is None:
            found = (f" (other versions there, which this tfds does not read: {', '.join(others)})"
                     if others else "")
            raise DatasetNotFoundError(
                f"dataset {name!r} is not prepared in {builder.data_dir} (data_dir={root}){found}; "
                f"no download is attempted. To prepare it, {how}. {_OFFLINE}")
        logging.info("Dataset %s: version %s is not prepared in %s; reading version %s, prepared "
                     "there.", name, builder.version, root, other.version)
        builder = other
    fmt = builder.info.file_format
    if random_access and fmt != tfds.core.FileFormat.ARRAY_RECORD:
        raise DatasetNotFoundError(
            f"dataset {name!r} in {builder.data_dir} is stored as {getattr(fmt, 'value', fmt)}, "
            f"which cannot be read by index; convert it with `tfds convert_format "
            f"--dataset_version_dir={builder.data_dir} --out_file_format=array_record`, or "
            f"rebuild it: {how}. {_OFFLINE}")
    return builder


def load_arrays(builder: Any, split: str, workers: int) -> tuple[np.ndarray, np.ndarray]:
    """A whole split in host memory: (uint8 images (N, H, W, 3), int32 labels (N,)).

    array_record data is read without TensorFlow; TFRecord data goes through tf.data in chunks
    (``batch_size=-1`` aborts the process under mock_data with TF 2.21).
    """
    tfds = _tfds()
    if not is_mocked() and builder.info.file_format == tfds.core.FileFormat.ARRAY_RECORD:
        ds = builder.as_data_source(split=split)
        with cf.ThreadPoolExecutor(workers) as ex:
            recs = list(ex.map(ds.__getitem__, range(len(ds))))
        images = np.stack([r["image"] for r in recs]) if recs else np.zeros((0, 1, 1, 3), np.uint8)
        labels = np.array([r["label"] for r in recs], np.int32)
    else:
        ds = builder.as_dataset(split=split, batch_size=1024, shuffle_files=False)
        chunks = list(tfds.as_numpy(ds))
        images = np.concatenate([c["image"] for c in chunks])
        labels = np.concatenate([c["label"] for c in chunks]).astype(np.int32)
    if images.shape[-1] == 1:
        images = np.repeat(images, 3, axis=-1)
    return images, labels


def open_random_access(builder: Any, split: str) -> Any:
    """An indexable source of records with the image left as encoded bytes."""
    tfds = _tfds()
    return builder.as_data_source(split=split, decoders={"image": tfds.decode.SkipDecoding()})


def serialized_examples(source: Any) -> Any | None:
    """The serialized ``tf.train.Example`` records behind a tfds array_record data source (same
    indices), or None where there are none (``mock_data``'s generated sources)."""
    raw = getattr(source, "data_source", None)
    try:
        from array_record.python.array_record_data_source import ArrayRecordDataSource
    except ImportError:
        return None
    return raw if isinstance(raw, ArrayRecordDataSource) and len(raw) == len(source) else None
