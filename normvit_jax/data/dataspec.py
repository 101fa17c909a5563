"""What the run's data is, resolved once: ``resolve_data_spec(config) -> DataSpec``.

``config.data.name`` is resolved here and nowhere else; everything downstream (pipelines, the
steps' input mapping, RandAugment's fill, the model's number of classes, evaluation, analysis)
takes the ``DataSpec``. Only where the dataset may be gone is the saved name read without it:
``run_data.affine`` (a dataset prepared again since the run) and ``analysis.report.data_spec_of``
(a run whose dataset is not readable here: the name labels it). ``validate`` and ``resolve_data_spec`` never touch the network or a tfds dataset's
records, so a bad config fails before any dataset is opened or anything is compiled.

Built-in datasets' classes and statistics are tables here; a dataset prepared by the user
(``python -m normvit_jax.data.prepare``, docs/data.md) is one more branch in ``resolve_data_spec``
that reads them from its ``prepare.json`` (``prepared.resolve``).
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import numbers
from typing import Any

import numpy as np

from normvit_jax.data import prepared, stats, transforms

NUM_CLASSES: dict[str, int] = {"digits": 10, "cifar10": 10, "cifar100": 100, "imagenet2012": 1000}
NORMALIZE = stats.NORMALIZE
# tfds datasets small enough to hold a split in host memory; the rest are read by random access.
IN_MEMORY_TFDS = ("cifar10", "cifar100")
# Evaluation-only datasets (config.data.eval_name) and the training set whose labels they share.
EVAL_ONLY_TFDS = {"imagenet_v2": "imagenet2012", "imagenet2012_real": "imagenet2012"}
# Splits tfds stores without labels (every label -1): training or evaluating on them would give a
# loss of 0 and 0% accuracy (one_hot(-1) is all zeros), so opening one is refused by name.
UNLABELLED_SPLITS: dict[str, tuple[str, ...]] = {"imagenet2012": ("test",)}
CLASS_NAMES: dict[str, tuple[str, ...]] = {
    "digits": tuple(str(i) for i in range(10)),
    "cifar10": ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship",
                "truck"),
}
# Split sizes known without opening anything (others are counted when the split is opened).
SPLIT_SIZES: dict[tuple[str, str], int] = {
    ("digits", "train"): 1442, ("digits", "test"): 355, ("digits", "validation"): 355}

Triple = tuple[float, float, float]


@dataclasses.dataclass(frozen=True)
class DataSpec:
    """The run's data as every other module sees it (frozen, hashable; built by
    ``resolve_data_spec``). Statistics are per channel, of the training set, in [0, 1] pixel units.
    """

    name: str                     # the training set ('digits' or a tfds name)
    eval_name: str                # the evaluated set (config.data.eval_name, else ``name``)
    train_split: str              # tfds split strings, e.g. 'train', 'test[:50%]'
    eval_split: str
    num_classes: int
    class_names: tuple[str, ...] | None  # None: not known without opening the dataset
    image_shape: tuple[int, int, int]    # model input (S, S, 3)
    normalize: str                # config.data.normalize: how pixels become model input
    mean: Triple
    std: Triple
    min: Triple
    max: Triple
    num_train_examples: int | None  # examples used; None: the whole split, counted when opened
    num_eval_examples: int | None
    data_dir: str | None = None   # tfds data_dir (None: tfds' default)

    @property
    def affine(self) -> tuple[np.ndarray, np.ndarray]:
        """(scale, shift), float32 (3,): model input = x01 * scale + shift (``normalize``)."""
        return stats.affine_of(self.stats(), self.normalize)

    def stats(self) -> dict[str, np.ndarray]:
        """``mean``, ``std``, ``min``, ``max``: float32 (3,) each."""
        f = lambda v: np.asarray(v, np.float32)  # noqa: E731
        return dict(mean=f(self.mean), std=f(self.std), min=f(self.min), max=f(self.max))


def num_classes(name: str) -> int:
    """Number of labels of a built-in dataset; raises ValueError naming the accepted datasets."""
    if name not in NUM_CLASSES:
        raise ValueError(f"config.data.name={name!r} is not a known dataset; accepted: "
                         f"{sorted(NUM_CLASSES)}")
    return NUM_CLASSES[name]


MAX_NAMES_SHOWN = 8  # prepared datasets named in a refusal (a shared data_dir may hold many)


def check_name(name: Any, data_dir: Any) -> None:
    """A built-in dataset, or one prepared by ``python -m normvit_jax.data.prepare`` in
    ``data_dir``; raises DatasetNotFoundError (a ValueError) naming both kinds otherwise."""
    if name in NUM_CLASSES:
        return
    if not isinstance(name, str) or not name:
        _fail("data.name", name, f"one of {sorted(NUM_CLASSES)} or a prepared dataset's name")
    if not (data_dir is None or isinstance(data_dir, str)) or not prepared.is_prepared(name, data_dir):
        from normvit_jax.data.errors import DatasetNotFoundError
        where = data_dir or prepared.default_data_dir()
        have = prepared.list_prepared(where) if isinstance(data_dir, (str, type(None))) else []
        # a misspelt prepared name ('my_fmm') was answered with the built-ins only
        guess = difflib.get_close_matches(name, have + sorted(NUM_CLASSES), n=1)
        shown = ", ".join(repr(n) for n in have[:MAX_NAMES_SHOWN]) + (
            f" and {len(have) - MAX_NAMES_SHOWN} more" if len(have) > MAX_NAMES_SHOWN else "")
        raise DatasetNotFoundError(
            f"config.data.name={name!r} is not a known dataset"
            + (f" (did you mean {guess[0]!r}?)" if guess else "")
            + f"; accepted: {sorted(NUM_CLASSES)}, or a dataset prepared in config.data.data_dir "
            f"({where}, which holds {shown or 'none'}) by `python -m "
            f"normvit_jax.data.prepare --src=YOUR_DATA --name={name} --data_dir={where}` "
            f"(docs/data.md)")


def resolve_data_spec(config: Any, num_devices: int = 1) -> DataSpec:
    """Checks ``config.data`` and the batch sizes (``validate``) and returns the run's DataSpec.

    ``num_devices``: the batches must split evenly over them (``check_batch_sizes``). Reads no
    tfds records (built-in datasets' classes and statistics are tables; digits' statistics are
    computed once from the bundled split; a prepared dataset's come from its prepare.json).
    Raises ValueError naming the key, value and accepted (DatasetNotFoundError: not prepared).
    """
    validate(config, num_devices)
    d = config.data
    name = _get(d, "name")
    size = int(d.image_size)
    if name not in NUM_CLASSES:  # validate: a dataset prepared by data.prepare
        eval_name = _get(d, "eval_name") or name
        p = prepared.resolve(name, _get(d, "data_dir"), d.train_split,
                             d.eval_split if eval_name == name else None)
        if eval_name != name:  # another prepared set of the same classes, evaluated only
            p["eval_split"] = _other_eval_set(eval_name, _get(d, "data_dir"), d.eval_split,
                                              p["class_names"], name)
        return DataSpec(
            name=name, eval_name=eval_name, train_split=p["train_split"],
            eval_split=p["eval_split"],
            num_classes=p["num_classes"], class_names=p["class_names"],
            image_shape=(size, size, 3), normalize=d.normalize, mean=p["mean"], std=p["std"],
            min=p["min"], max=p["max"], num_train_examples=_get(d, "num_train_examples"),
            num_eval_examples=_get(d, "num_eval_examples"), data_dir=_get(d, "data_dir"))
    mean, std, lo, hi = stats.dataset_stats_tuple(name)
    eval_name = _get(d, "eval_name") or name
    return DataSpec(
        name=name, eval_name=eval_name, train_split=d.train_split, eval_split=d.eval_split,
        num_classes=num_classes(name), class_names=CLASS_NAMES.get(name),
        image_shape=(size, size, 3), normalize=d.normalize, mean=mean, std=std, min=lo, max=hi,
        num_train_examples=(_get(d, "num_train_examples")
                            or SPLIT_SIZES.get((name, d.train_split))),
        num_eval_examples=(_get(d, "num_eval_examples")
                           or SPLIT_SIZES.get((eval_name, d.eval_split))),
        data_dir=_get(d, "data_dir"))


def _other_eval_set(eval_name: str, data_dir: str | None, eval_split: str,
                    class_names: tuple[str, ...], name: str) -> str:
    """The split of ``eval_name`` to evaluate on, a prepared dataset with the training set's
    classes in the same order (labels are indices); the training set's statistics normalize it,
    as the model was trained. ValueError naming both sets otherwise."""
    try:
        e = prepared.resolve(eval_name, data_dir, None, eval_split)
    except prepared.DatasetNotFoundError as err:
        raise ValueError(f"config.data.eval_name={eval_name!r}: {err}") from None
    if e["class_names"] != tuple(class_names):
        raise ValueError(f"config.data.eval_name={eval_name!r} has the classes "
                         f"{list(e['class_names'])}, the run's {name!r} {list(class_names)}; "
                         "accepted: a prepared dataset of the same classes (prepare it from "
                         "folders of the same names)")
    return e["eval_split"]


def _get(c: Any, key: str, default: Any = None) -> Any:
    return c.get(key, default) if hasattr(c, "get") else getattr(c, key, default)


@functools.lru_cache(maxsize=1)
def _data_defaults() -> dict[str, Any]:
    from configs import default
    return default.get_config().data.to_dict()


def setting(d: Any, key: str) -> Any:
    """``config.data.<key>``; where the config lacks it (a config.json written before the key
    existed, read by predict or the analysis tools) the value configs/default.py documents: the
    one place a data default is written."""
    return d[key] if key in d else _data_defaults()[key]


def _is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _fail(key: str, value: Any, accepted: str) -> None:
    raise ValueError(f"config.{key}={value!r} is invalid; accepted: {accepted}")


def validate(config: Any, num_devices: int = 1) -> None:
    """Checks ``config.data``, the seed and the batch sizes (``check_batch_sizes``).

    Raises ValueError naming the key, its value and what is accepted. Reads nothing from disk but
    for a name that is not built in: whether it is prepared (``prepared.is_prepared``).
    """
    d = config.data
    check_name(_get(d, "name"), _get(d, "data_dir"))
    if _get(d, "normalize") not in NORMALIZE:
        _fail("data.normalize", _get(d, "normalize"), str(list(NORMALIZE)))
    for key in ("image_size",):
        v = _get(d, key)
        if not _is_int(v) or v < 1:
            _fail(f"data.{key}", v, "an integer >= 1")
    for key in ("crop_padding", "prefetch"):
        v = _get(d, key, 0)
        if not _is_int(v) or v < 0:
            _fail(f"data.{key}", v, "an integer >= 0")
    r = _get(d, "repeated_aug", 1)
    if not _is_int(r) or r < 1:
        _fail("data.repeated_aug", r, "an integer >= 1 (1: off)")
    for key in ("num_train_examples", "num_eval_examples", "num_workers"):
        v = _get(d, key)
        if v is not None and (not _is_int(v) or v < 1):
            _fail(f"data.{key}", v, "None or an integer >= 1")
    for key in ("min_crop_area", "eval_crop_fraction"):
        v = _get(d, key, 1.0)
        if not isinstance(v, numbers.Real) or isinstance(v, bool) or not 0.0 < v <= 1.0:
            _fail(f"data.{key}", v, "a number in (0, 1]")
    for key in ("flip", "random_resized_crop", "return_index", "antialias"):
        v = _get(d, key, False)
        if not isinstance(v, bool):
            _fail(f"data.{key}", v, "True or False")
    rs = _get(d, "eval_resize_small", 0)
    if not _is_int(rs) or (rs != 0 and rs < _get(d, "image_size")):
        _fail("data.eval_resize_small", rs, f"0 (off) or an integer >= data.image_size="
              f"{_get(d, 'image_size')} (the central crop's side)")
    interp = _get(d, "interpolation", "bilinear")
    if interp not in transforms.INTERPOLATIONS:
        _fail("data.interpolation", interp, f"one of {list(transforms.INTERPOLATIONS)}")
    for key in ("train_split", "eval_split"):
        v = _get(d, key, "x")
        if not isinstance(v, str) or not v:
            _fail(f"data.{key}", v, "a non-empty tfds split string such as 'train' or 'test[:50%]'")
    en, name = _get(d, "eval_name"), _get(d, "name")
    own = (name not in NUM_CLASSES and en is not None and en not in NUM_CLASSES  # both prepared
           and en not in EVAL_ONLY_TFDS)
    if en is not None and en != name and EVAL_ONLY_TFDS.get(en) != name and not own:
        _fail("data.eval_name", en, f"None, {name!r}, for imagenet2012: "
              f"{sorted(EVAL_ONLY_TFDS)}, or for a prepared dataset another prepared dataset of "
              "its classes")
    dd = _get(d, "data_dir")
    if dd is not None and not isinstance(dd, str):
        _fail("data.data_dir", dd, "None or a path string")
    if not _is_int(_get(config, "seed", 0)):
        _fail("seed", _get(config, "seed"), "an integer")
    check_batch_sizes(config, num_devices)


def check_labelled(key: str, dataset: str, split: str) -> None:
    """Refuses a split string that reads one of ``UNLABELLED_SPLITS`` (``'test'``, ``'test[:10%]'``,
    ``'validation+test'``). Called where a split is opened (``make_pipeline``), not by
    ``validate``: a run's saved config naming one still predicts and exports. tfds's ``'all'``
    reads every split, the unlabelled ones included."""
    parts = {p.split("[")[0].strip() for p in split.split("+")}
    unlabelled = set(UNLABELLED_SPLITS.get(dataset, ()))
    bad = sorted(parts & unlabelled) or (sorted(unlabelled) if "all" in parts else [])
    if bad:
        within = " ('all' reads it too)" if bad[0] not in parts else ""
        _fail(f"data.{key}", split, f"a labelled split of {dataset!r}: its {bad[0]!r} split has no "
              f"labels{within} (tfds stores -1; the loss would be 0 and the accuracy 0%); "
              "ImageNet's labelled held-out split is 'validation'")


def check_batch_sizes(config: Any, num_devices: int = 1) -> None:
    """The one check of the global batch sizes: integers >= 1, ``batch_size`` a multiple of
    ``grad_accum_steps``, and each step's batch (train micro-batch, eval batch) a multiple of the
    number of devices, hence also of the number of processes (each holds as many devices)."""
    for key in ("batch_size", "eval_batch_size"):
        v = _get(config, key)
        if not _is_int(v) or v < 1:
            _fail(key, v, "an integer >= 1")
    k = _get(config, "grad_accum_steps", 1)
    if not _is_int(k) or k < 1 or config.batch_size % k:
        raise ValueError(f"config.grad_accum_steps={k} must be >= 1 and divide "
                         f"config.batch_size={config.batch_size}")
    n = int(num_devices)
    for key, value in (("batch_size", config.batch_size // k),
                       ("eval_batch_size", config.eval_batch_size)):
        if value % n:
            what = "batch_size / grad_accum_steps" if key == "batch_size" and k > 1 else key
            raise ValueError(f"config.{what}={value} is not divisible by the number of devices "
                             f"({n}); accepted: a multiple of {n}")
