"""Class predictions of a trained (or reparam-folded) model on your images, with class names.

    python -m normvit_jax.predict --workdir=W --images=DIR_OR_FILES [--top_k=5] [--out=preds.csv]
    python -m normvit_jax.predict --workdir=W --folded=FOLDED_DIR --images=...   # folded weights
    python -m normvit_jax.predict --workdir=W --mode=eval --split=SPLIT            # a labelled split
    python -m normvit_jax.predict --workdir=W --weights=ema --images=...  # a run's weight EMA
    python -m normvit_jax.predict --workdir=W --images=new_photos/ --labels=folders --out=p.csv

--images: files and folders, comma-separated (folders are read as prepare reads a class folder).
Each image follows prepare's RGB rule (docs/data.md) and the run's eval preprocessing (central crop
data.eval_crop_fraction, resize to data.image_size, data.normalize with the statistics the run
trained with: <workdir>/data.json, else the dataset's) through the same decoder as evaluation.
Each image is decoded once (a JPEG or PNG that needs no change by TensorFlow alone, its header read
by PIL; any other by PIL, then its lossless PNG as prepare stores it), and the files are read,
decoded and predicted one --batch at a time, so a folder of any size fits in memory. Class names:
<workdir>/classes.json (written by training), else the dataset's, else the label numbers.
Unreadable files are listed and skipped (also one that PIL reads and TensorFlow does not, which
stopped the whole prediction), and so is an image that data.eval_resize_small would resize past
serve's default pixel limit (deploy.preprocess.check_pixels). --mode=eval evaluates the checkpoint on
a split of the run's dataset (or --name/--data_dir) like ``main.py --mode=eval``.
--labels=folders: the images lie in folders named as the run's classes (prepare's DIR/<class>/...
layout, no dataset prepared): each row also says its true class and whether the top-1 is right,
then the top-1 over them, the classes with the lowest top-1, each wrong image, and with --out a
confusion-matrix picture and one of the wrong images beside the CSV (labelled.py).
"""
from __future__ import annotations

import csv
import errno
import json
import os
import sys
from typing import Any, Iterator, Sequence

import numpy as np

EXIT_BAD_INPUT = 2


def _paths(spec: str) -> Iterator[str]:
    """The comma-separated paths of ``spec``; a path holding commas ('Paris, France/') is taken
    whole: the longest run of parts that names an existing file or folder (it was split and
    refused as 'Paris is neither a file nor a folder')."""
    parts, i = spec.split(","), 0
    while i < len(parts):
        j = next((j for j in range(len(parts), i, -1)
                  if os.path.exists(",".join(parts[i:j]).strip())), i + 1)
        part, i = ",".join(parts[i:j]).strip(), j
        if part:
            yield part


def list_images(spec: str) -> list[str]:
    """Files named by ``--images``: comma-separated files and folders (walked, sorted)."""
    out = []
    for part in _paths(spec):
        if os.path.isdir(part):
            from normvit_jax.data import formats  # prepare's walk: linked folders followed once
            try:
                out += formats.walk_files(part)
            except OSError as e:  # a folder that cannot be listed was skipped silently
                raise FileNotFoundError(f"--images: {e.filename or part} cannot be listed "
                                        f"({e.strerror or e})") from None
        elif os.path.isfile(part):
            out.append(part)
        else:
            raise FileNotFoundError(f"--images: {part} is neither a file nor a folder" + (
                " (--images is split at commas)" if "," in spec else ""))
    if not out:
        raise FileNotFoundError(f"--images={spec}: no files found")
    return out


def run_class_names(workdir: str, config: Any) -> list[str]:
    """The run's class names: its classes.json, else the dataset's; [] if neither has them."""
    from normvit_jax import run_config
    path = os.path.join(workdir, "classes.json")
    if os.path.isfile(path):
        advice = "restore it, or delete it to use the dataset's class names"
        names = run_config.read_json(path, advice)
        if not isinstance(names, list):  # a number was a TypeError, an object its keys
            raise ValueError(f"{path} is not a list of class names (JSON "
                             f"{type(names).__name__}); {advice}")
        return [str(c) for c in names]
    return list(_spec(config).class_names or [])


def class_names(workdir: str, config: Any, num_classes: int) -> list[str]:
    names = run_class_names(workdir, config)
    return names if len(names) == num_classes else [str(i) for i in range(num_classes)]


def check_folded(folded: str, num_classes: int, workdir: str, config: Any) -> None:
    """A --folded folder of another run: a model of another class count would be labelled with
    numbers instead of the run's names, silently."""
    names = run_class_names(workdir, config)
    if names and len(names) != num_classes:
        raise ValueError(f"--folded={folded} holds a model of {num_classes} classes, but the run "
                         f"{workdir} has {len(names)}; fold this run: python -m "
                         f"normvit_jax.reparam --workdir={workdir} --out=DIR")


def _spec(config: Any) -> Any:
    from normvit_jax.data import dataspec
    return dataspec.resolve_data_spec(config)


def eval_geometry(d: Any) -> Any:
    """The eval pipeline's geometry (``pipeline.Pipeline``): central crop, resize, no flip (or
    ``data.eval_resize_small``: resize, then the central crop)."""
    from normvit_jax.data import transforms
    from normvit_jax.data.dataspec import setting
    from normvit_jax.data.sources import Geometry
    interp = str(setting(d, "interpolation"))
    return Geometry(int(d.image_size), False, 1.0, float(d.eval_crop_fraction),
                    antialias=bool(setting(d, "antialias")),
                    interpolation=transforms.pick_interpolation(interp, None),
                    resize_small=int(setting(d, "eval_resize_small") or 0))


DEFAULT_TOP_K = 5  # serve's: at most the model's classes unless asked for


ACCEPTED_FILES = ("image files: one path (a str or os.PathLike; a folder is read as --images "
                  "reads one) or a sequence of file paths")


def image_files(files: Any) -> list[str]:
    """``predict``'s ``files`` as a list of paths: one str/PathLike path (a file, or a folder
    walked as ``list_images`` walks one: it was a sequence of its characters) or an iterable of
    paths; anything else (a numpy array, a PIL image, bytes) is a TypeError naming what is
    accepted, not one from deep inside the decoder."""
    if isinstance(files, (str, os.PathLike)):
        path = os.fspath(files)
        if not isinstance(path, str):
            raise TypeError(f"predict() takes {ACCEPTED_FILES}; got the bytes path {path!r}")
        if not os.path.exists(path):  # (list_images would split it at its commas)
            raise FileNotFoundError(f"{path} is neither a file nor a folder")
        return list_images(path)  # an existing path is taken whole, commas and all
    pixels = hasattr(files, "__array__") and getattr(getattr(files, "dtype", None), "kind",
                                                       "") not in ("U", "O")  # not of paths
    if isinstance(files, (bytes, bytearray)) or not hasattr(files, "__iter__") or pixels:
        raise TypeError(f"predict() takes {ACCEPTED_FILES}; got {_type_name(files)}"
                        + _in_memory(files))
    out = []
    for i, f in enumerate(files):
        if isinstance(f, os.PathLike):
            f = os.fspath(f)
        if not isinstance(f, str):
            raise TypeError(f"predict() takes {ACCEPTED_FILES}; files[{i}] is "
                            f"{_type_name(f)}" + _in_memory(f))
        out.append(str(f))  # (numpy's str_ too)
    return out


def _in_memory(x: Any) -> str:
    """The hint for pixels or encoded bytes passed instead of a file."""
    image = isinstance(x, (bytes, bytearray)) or hasattr(x, "__array__") \
        or hasattr(x, "__array_interface__")
    return " (an image in memory: save it as a PNG file and pass its path)" if image else ""


def _type_name(x: Any) -> str:
    t = type(x)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def predict(workdir: str, files: Any, *, top_k: int | None = None,
            step: int | None = None,
            folded: str | None = None, batch: int = 64, weights: str | None = None
            ) -> tuple[list[dict], list[str]]:
    """(rows, skipped): per readable file ``{'path', 'top': [(class, prob), ...]}``; skipped:
    'path (reason)' for files that are not decodable images. ``files``: one path (str or
    os.PathLike; a folder is read as --images reads one) or a sequence of file paths
    (``image_files``; a TypeError for anything else, e.g. a numpy array). ``top_k``:
    1..classes (ValueError otherwise, as serve's 400); None: DEFAULT_TOP_K or the classes if
    fewer. ``weights``: --weights (``checkpoints.choose_weights``; a --folded folder holds the
    weights it was folded from)."""
    import jax
    from normvit_jax import checkpoints, models, reparam, run_data
    from normvit_jax.data import stats, tf_images

    files = image_files(files)  # before the model is loaded: a wrong argument says so at once
    config = checkpoints.load_config(workdir)
    if folded:
        model_cfg, variables, n = reparam.load(folded)
        check_folded(folded, n, workdir, config)
    else:
        # the shared restore path, the raw or EMA weights (--weights)
        variables, _, _ = checkpoints.restore_weights(workdir, step, weights)
        model_cfg, n = config.model, int(np.shape(variables["params"]["head"]["bias"])[-1])
    if top_k is not None and not 1 <= top_k <= n:  # 20 of 10 classes showed 10, silently
        raise ValueError(f"--top_k={top_k}: must be an integer from 1 to {n} (the number of "
                         "classes)")
    model = models.create(model_cfg, n)
    names = class_names(workdir, config, n)
    affine = run_data.affine(workdir, config)  # as trained: no dataset needed (run_data.py)
    geo = eval_geometry(config.data)
    apply = jax.jit(lambda v, x: jax.nn.softmax(
        model.apply(v, stats.model_input(x, affine), train=False), -1))
    decoder = tf_images.BatchDecoder(min(8, os.cpu_count() or 1))
    rows, skipped, k = [], [], min(DEFAULT_TOP_K, n) if top_k is None else top_k
    bar = _progress(None, "predicting", len(files))
    # one batch of files at a time: read, decoded, predicted, then dropped (a folder of any size
    # holds one batch in memory)
    for lo in range(0, len(files), batch):
        chunk = files[lo:lo + batch]
        kept, x, bad = _decode(chunk, geo, decoder)
        skipped += bad
        if kept:
            pad = batch - len(kept)  # one compiled shape for every batch
            x = np.concatenate([x, np.zeros((pad,) + x.shape[1:], x.dtype)]) if pad else x
            probs = np.asarray(apply(variables, x))[: len(kept)]
            for path, p in zip(kept, probs):
                top = np.argsort(-p, kind="stable")[:k]
                rows.append({"path": path, "top": [(names[j], float(p[j])) for j in top]})
        bar.update(len(chunk))
    bar.close()
    return rows, skipped


def _encoded(path: str, resize_small: int = 0) -> bytes:
    """The bytes evaluation would decode for ``path`` (prepare's rule): a JPEG or PNG that needs no
    change as it is, read from its header only (TensorFlow decodes it, once); any other image
    decoded by PIL and stored as the PNG of its RGB pixels. Raises BadImageError or OSError, and
    deploy.preprocess.InputError for an image that ``resize_small`` would resize past serve's
    default pixel limit (a 3x10000 strip to a short side of 256 is ~4 GB and ~20 s). A large photo
    as it is stays: it is the user's own file, not a request to a service."""
    from normvit_jax.data import images
    from normvit_jax.deploy import preprocess
    from normvit_jax.serve import DEFAULT_MAX_PIXELS
    data = images.read_file(path)  # a video: its first bytes only
    preprocess.check_pixels(data, DEFAULT_MAX_PIXELS, {"eval_resize_small": resize_small},
                            limit="predict's limit, as serve's default", as_is=False)
    return images.as_stored(data)


def _decode(paths: Sequence[str], geo: Any, decoder: Any
            ) -> tuple[list[str], np.ndarray, list[str]]:
    """(paths decoded, their uint8 eval images, 'path (reason)' of the files skipped, in order)."""
    from normvit_jax.data import images, tf_images
    from normvit_jax.deploy import preprocess
    why: dict[int, str] = {}
    encoded: dict[int, bytes] = {}
    for i, path in enumerate(paths):
        try:
            encoded[i] = _encoded(path, geo.resize_small)
        except (images.BadImageError, OSError, preprocess.InputError) as e:
            why[i] = str(e)
    while True:
        order = sorted(encoded)
        try:
            x, _ = decoder([encoded[i] for i in order], None, geo)
            break
        except tf_images.BadImageError as e:  # a kept file TensorFlow cannot decode: skip it
            i = order[e.position]
            why[i] = images.undecodable(encoded.pop(i))
    return ([paths[i] for i in order], x,
            [f"{paths[i]} ({why[i]})" for i in sorted(why)])


PROGRESS_MIN_IMAGES = 256  # fewer finish in seconds: no bar


def _progress(items: Any, what: str, total: int) -> Any:
    """A progress bar on stderr (cleared when done) for work of at least PROGRESS_MIN_IMAGES."""
    from tqdm import tqdm
    return tqdm(items, desc=what, total=total, unit="img", file=sys.stderr, dynamic_ncols=True,
                leave=False, disable=total < PROGRESS_MIN_IMAGES)


def write_csv(rows: list[dict], path: str, top_k: int) -> None:
    # the folders check_output said would be made (--out=new/dir/x.csv), as export makes its own:
    # missing, every image was predicted and the write raised FileNotFoundError (results lost)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    # surrogateescape: a file name that is not UTF-8 is written as its own bytes (the path of the
    # file on disk), not a UnicodeEncodeError once every image was predicted
    # written to a temporary name, then renamed: a full disk leaves no empty or cut CSV, and a CSV
    # already at ``path`` as it was (OSError raised, after the temporary file is removed)
    tmp = os.path.join(os.path.dirname(os.path.abspath(path)),
                       f".{os.path.basename(path)}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", newline="", encoding="utf-8", errors="surrogateescape") as f:
            w = csv.writer(f)
            labelled = bool(rows) and "true" in rows[0]  # --labels=folders
            w.writerow(["path"] + ["true_class", "correct"] * labelled
                       + [h for r in range(1, top_k + 1) for h in (f"class_{r}", f"prob_{r}")])
            for row in rows:
                w.writerow([row["path"]]
                           + ([row["true"], int(row["correct"])] if labelled else [])
                           + [v for c, p in row["top"] for v in (c, f"{p:.6f}")])
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise


def typed_flags(message: str, typed: dict[str, tuple[str, str]]) -> str:
    """``message`` (the data checks', which name config keys as main.py's flags do) with the
    values predict's flags set named as those flags: ``config.data.eval_split='tset'`` is
    ``--split=tset``, the flag the user typed. ``typed``: {config.data key: (flag, value)}."""
    for key, (flag, value) in typed.items():
        message = message.replace(f"config.data.{key}={value!r}", f"--{flag}={value}")
        if key == "eval_name":  # the evaluated set's own check names it as a dataset
            message = message.replace(f"config.data.name={value!r}", f"--name={value}")
        if key == "data_dir":
            message = message.replace(f"config.data.data_dir ({value})", f"--data_dir={value}")
    return message


def main(argv: Sequence[str] | None = None) -> Any:
    from normvit_jax import cli, logs, tool_flags
    logs.quiet_library_logs()
    p = tool_flags.Parser("python -m normvit_jax.predict", __doc__)
    p.add_argument("--workdir", required=True, help="the training run's workdir")
    p.add_argument("--images", default=None, help="image files and folders, comma-separated")
    p.add_argument("--top_k", type=int, default=None, help=f"classes shown per image, 1 to the "
                   f"model's classes (default: {DEFAULT_TOP_K}, or the classes if fewer)")
    p.add_argument("--out", default=None, help="CSV file to write (path, class_1, prob_1, ...)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    p.add_argument("--folded", default=None, help="folder written by `python -m "
                   "normvit_jax.reparam --out=...`: predict with the folded weights (not with "
                   "--step or --mode=eval)")
    tool_flags.add_weights(p)
    p.add_argument("--batch", type=int, default=64, help="images per forward pass")
    p.add_argument("--labels", default=None, choices=["folders"],
                   help="folders: the images lie in folders named as the run's classes; also "
                   "report the true class, the top-1 over them, the wrong images and (with --out) "
                   "pictures of the confusion matrix and of the wrong images")
    p.add_argument("--mode", default="predict", choices=["predict", "eval"],
                   help="predict: label --images; eval: metrics on --split of a prepared dataset")
    p.add_argument("--split", default=None, help="--mode=eval: split (default: the run's "
                   "data.eval_split)")
    p.add_argument("--name", default=None, help="--mode=eval: dataset (default: the run's; for a run "
                   "on a prepared dataset, another prepared one of its classes)")
    p.add_argument("--data_dir", default=None, help="--mode=eval: its tfds data dir")
    args = p.parse_args(argv)
    with cli.tool_errors(p.prog):  # docs/faults.md: one line and the table's exit code
        return _main(args, p.prog)


def _main(args: Any, prog: str) -> Any:
    from normvit_jax import checkpoints, cli, tool_flags
    config = checkpoints.load_config(args.workdir)
    if args.folded and args.step is not None:  # the folder is one model: --step went unused
        print(f"{prog}: error: --step={args.step} picks a checkpoint, but --folded={args.folded} "
              f"holds one folded model; fold that step first (python -m normvit_jax.reparam "
              f"--workdir={args.workdir} --step={args.step} --out=DIR), then --folded=DIR "
              f"without --step", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    if args.weights and (args.folded or args.mode == "eval"):  # it would go unused
        print(f"{prog}: error: --weights={args.weights}: " + (
            f"--folded={args.folded} holds one folded model (its model.json says which weights; "
            f"reparam --weights=... --out=DIR folds the others)" if args.folded else
            "--mode=eval reports both: the metrics of the raw weights and, for a run with an "
            "EMA, ema_*") + "; leave --weights out", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    if args.mode == "eval":
        if args.labels:  # a prepared split has its labels: --labels went unused
            print(f"{prog}: error: --labels={args.labels} labels --images by their folders; "
                  f"--mode=eval takes the labels of the prepared split, and its result already "
                  f"holds per_class and the confusion matrix: leave --labels out", file=sys.stderr)
            sys.exit(EXIT_BAD_INPUT)
        if args.folded:  # evaluate_checkpoint reads checkpoints: --folded went unused
            print(f"{prog}: error: --mode=eval evaluates the run's checkpoints, not --folded="
                  f"{args.folded}; reparam checked that the folded model's logits equal its step's: "
                  f"evaluate that step (--step=N) without --folded",
                  file=sys.stderr)
            sys.exit(EXIT_BAD_INPUT)
        typed = {}  # config key -> the flag the user typed for it
        with config.unlocked():
            for key, flag, v in (("eval_name", "name", args.name), ("eval_split", "split",
                                 args.split), ("data_dir", "data_dir", args.data_dir)):
                if v is not None:
                    config.data[key] = v
                    typed[key] = (flag, v)
        # not cli.evaluate, which logs main.py's 'Stopped: ...': the errors reach tool_errors
        from normvit_jax import evaluation
        try:
            result = evaluation.evaluate_checkpoint(config, args.workdir, args.step)
        except ValueError as e:
            e.args = (typed_flags(str(e), typed),) + e.args[1:]
            raise
        print(json.dumps(result, sort_keys=True))
        return cli.EXIT_OK
    bad = ["--images=FILES_OR_FOLDERS is required"] if not args.images else []
    # --batch=0 failed inside range(), a negative one predicted nothing and exited 0
    bad += [f"--{k}={v}: must be >= 1" for k, v in (("top_k", args.top_k), ("batch", args.batch))
            if v is not None and v < 1]
    if bad:
        print(f"{prog}: error: {'; '.join(bad)}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    if args.out:
        tool_flags.check_output("out", args.out)  # before the work, not a traceback after it
    try:  # --images naming nothing, a --folded folder that reparam did not write
        files = list_images(args.images)
        labels = None
        if args.labels:  # checked before the model runs
            from normvit_jax import labelled
            labels = labelled.folder_labels(args.images)
            names = run_class_names(args.workdir, config)
            if not names:
                raise ValueError(f"--labels=folders: the run {args.workdir} has no class names "
                                 f"(no classes.json, none in its dataset) to match the folders to")
            labelled.check_labels(labels, names)
        rows, skipped = predict(args.workdir, files, top_k=args.top_k, step=args.step,
                                folded=args.folded, batch=args.batch, weights=args.weights)
    except FileNotFoundError as e:
        if isinstance(e, checkpoints.RunNotFoundError):
            raise
        print(f"{prog}: error: {e}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    from normvit_jax.data.formats import shown  # a file name that is not UTF-8, printable
    for row in rows:
        print(f"{shown(row['path'])}: " + ", ".join(f"{c} {p:.3f}" for c, p in row["top"]))
    for s in skipped:
        print(f"skipped (not a readable image): {shown(s)}", file=sys.stderr)
    if not rows:  # every file skipped: exit 0 and an empty CSV would read as success
        print(f"{prog}: error: none of the {len(skipped)} file(s) of --images is a readable image",
              file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    summary = None
    if labels is not None:
        lines, summary = labelled.summary(rows, labels, names)
        print("\n".join(lines))
    if args.out:
        try:
            write_csv(rows, args.out, len(rows[0]["top"]))
        except OSError as e:  # a full disk: one line, nothing half-written (the rows are printed)
            hint = "free disk space" if e.errno == errno.ENOSPC else "fix its permissions"
            print(f"{prog}: error: cannot write --out={args.out} ({type(e).__name__}: {e}); "
                  f"{hint} or pass another --out", file=sys.stderr)
            sys.exit(EXIT_BAD_INPUT)
        print(f"wrote {len(rows)} predictions to {args.out}")
        if summary is not None:
            labelled.pictures(summary, rows, args.out, args.workdir, eval_geometry(config.data))
    return rows, skipped


if __name__ == "__main__":
    from normvit_jax import logs as _logs  # absl's log format, as main.py's
    _logs.absl_format()
    main()
