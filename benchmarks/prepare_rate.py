"""Images/s of ``python -m normvit_jax.data.prepare`` on a folder of JPEGs (and optionally on IDX).

    python -m benchmarks.prepare_rate --images=1000 [--workers=2] [--idx=/path/to/mnist_idx_folder]

Makes ``--images`` synthetic JPEGs at ImageNet's usual sizes (400-500 x 333-375 px, ~105 kB, as
``benchmarks.input_pipeline``'s synthetic set) in 10 class folders, then times the prepare step
(read, decode to check and for the statistics, write array_record; the JPEGs keep their bytes),
excluding the one-off TensorFlow import. ``--idx``: also times a folder of IDX files (every image
re-encoded as PNG).

    python -m benchmarks.prepare_rate --images=512 --train_input --batches=10

then also measures the train input pipeline (``data.make_pipeline(config, 'train')``, the ImageNet
preset at 224 px: random resized crop, flip, bilinear) on the prepared folder against the same
pipeline on the ImageNet path (``benchmarks.input_pipeline``'s synthetic array_record
imagenet2012 of the same kind of JPEGs), images/s and per core, alternating the two.
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
from typing import Any, Sequence

import numpy as np


def make_jpeg_folder(root: str, n: int, classes: int = 10) -> None:
    from benchmarks.input_pipeline import _jpeg
    rng = np.random.default_rng(0)
    for i in range(n):
        d = os.path.join(root, f"class_{i % classes:02d}")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, f"{i:06d}.jpg"), "wb") as f:
            f.write(_jpeg(rng, int(rng.integers(333, 376)), int(rng.integers(400, 501))))


def time_prepare(src: str, data_dir: str, name: str, workers: int) -> tuple[float, int]:
    """(seconds, images written) of parse + write (TensorFlow already imported)."""
    from normvit_jax.data import prepare
    t = time.perf_counter()
    _, parsed, held = prepare.parse_source(src, None, 0.0, 0)  # all in train
    info = prepare.write(parsed, name, data_dir, strict=False, workers=workers,
                         extra=dict(format="bench", source=src, held_out=held))
    return time.perf_counter() - t, sum(s["examples"] for s in info["splits"].values())


def train_input_rates(tmp: str, workers: int, batches: int, repeats: int, n: int
                      ) -> list[dict[str, Any]]:
    """Images/s of the 224 px train pipeline: prepared folder vs synthetic imagenet2012."""
    from benchmarks.input_pipeline import pipeline_rate, synthetic_imagenet
    from configs import default
    from normvit_jax import data
    synthetic_imagenet(os.path.join(tmp, "inet"), n)
    rates: dict[str, list[float]] = {"prepared": [], "imagenet2012": []}
    pipes = {}
    for name, dd in (("prepared", os.path.join(tmp, "dd")), ("imagenet2012", os.path.join(tmp, "inet"))):
        c = default.get_imagenet(default.get_config())
        c.data.name, c.data.data_dir = ("bench_jpeg" if name == "prepared" else name), dd
        c.data.eval_split = "validation" if name == "imagenet2012" else "train"
        c.data.num_workers, c.batch_size = workers, min(64, n)
        pipes[name] = data.make_pipeline(c, "train")
    for _ in range(repeats):  # alternated: a shared machine's speed drifts
        for name, pipe in pipes.items():
            rates[name].append(pipeline_rate(pipe, batches))
    cores = len(os.sched_getaffinity(0))
    return [{"source": f"train input 224 px, {name} (median of {repeats})",
             "images": min(64, n) * batches,
             "seconds": None, "images_s": round(float(np.median(r)), 1),
             "images_s_per_core": round(float(np.median(r)) / cores, 1)} for name, r in rates.items()]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Bad input (an --idx that prepare refuses): one line and exit 2, Ctrl-C one line and 130
    (docs/faults.md)."""
    from normvit_jax import cli
    with cli.tool_errors("python -m benchmarks.prepare_rate"):
        return _main(argv)


def _main(argv: Sequence[str] | None) -> dict[str, Any]:
    from benchmarks import common
    from normvit_jax import logs, tool_flags
    from normvit_jax.data.formats import PrepareError
    logs.quiet_library_logs()
    p = tool_flags.Parser("python -m benchmarks.prepare_rate", __doc__)
    p.add_argument("--images", type=tool_flags.positive_int, default=1000,
                   help="synthetic JPEGs to prepare")
    p.add_argument("--workers", type=tool_flags.positive_int, default=None,
                   help="decode threads (default: cores)")
    p.add_argument("--idx", default=None, help="also time this folder of IDX files")
    p.add_argument("--train_input", action="store_true", help="also time the train pipeline on "
                   "the prepared folder against the ImageNet path, at 224 px")
    p.add_argument("--batches", type=tool_flags.positive_int, default=10,
                   help="--train_input: timed batches")
    p.add_argument("--repeats", type=tool_flags.positive_int, default=3,
                   help="--train_input: alternations")
    args = p.parse_args(argv)
    if args.images < 2:  # was prepare's PrepareError traceback: one class is no classifier
        raise ValueError(f"--images={args.images}: accepted: an integer >= 2 (the images are "
                         "spread over up to 10 classes; prepare needs two)")
    if args.idx and not os.path.isdir(args.idx):  # before the work, not after the JPEG timing
        raise ValueError(f"--idx={args.idx}: not a folder (one of IDX files)")
    import tensorflow_datasets  # noqa: F401  (imported once, outside the timing)
    import tensorflow  # noqa: F401
    workers = args.workers or len(os.sched_getaffinity(0))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        make_jpeg_folder(os.path.join(tmp, "src"), args.images)
        print(f"{args.images} JPEGs written in {time.perf_counter() - t:.1f} s", file=sys.stderr)
        s, n = time_prepare(os.path.join(tmp, "src"), os.path.join(tmp, "dd"), "bench_jpeg", workers)
        rows.append({"source": "JPEG folder (~105 kB, ~450x350)", "images": n, "seconds": round(s, 2),
                     "images_s": round(n / s, 1)})
        if args.train_input:
            rows += train_input_rates(tmp, workers, args.batches, args.repeats, args.images)
        if args.idx:
            try:
                s, n = time_prepare(args.idx, os.path.join(tmp, "dd"), "bench_idx", workers)
            except PrepareError as e:  # prepare's own refusal of the folder: exit 2
                raise ValueError(f"--idx={args.idx}: {e}") from None
            rows.append({"source": f"IDX {os.path.basename(args.idx.rstrip('/'))} (28x28, PNG)",
                         "images": n, "seconds": round(s, 2), "images_s": round(n / s, 1)})
    res = {"machine": common.machine(), "workers": workers, "rows": rows}
    print(f"machine: {res['machine']}; {workers} decode threads")
    for r in rows:
        print(f"  {r['source']}: {r['images']} images, {r['images_s']} images/s"
              + (f" ({r['images_s_per_core']} per core)" if "images_s_per_core" in r else ""))
    return res


if __name__ == "__main__":
    main()
