"""Train-pipeline throughput per dataset on this host, next to what the train step consumes.

    python -m benchmarks.input_pipeline --datasets=digits,cifar10,imagenet2012 --batches=20

For each dataset, with its default config (digits: the demo; CIFAR: Ti/4 at 32; ImageNet: the
``:imagenet`` variant, S/16 at 224):
  pipeline   examples/s of ``data.make_pipeline(config, 'train').train_batches()`` alone (the
             real prefetching iterator: reading, decoding, augmentation, normalisation);
  step       examples/s that the LayerNorm train step consumes on this host's devices;
  in a run   the two together as the loop runs them (the pipeline's threads share the host with
             the step): the fraction of wall time spent waiting in ``next(batches)``.
A run never waits for data when pipeline examples/s > step examples/s with room to spare and the
wait fraction is ~0. Data: the prepared tfds dataset in ``--data_dir`` when it exists; otherwise
CIFAR under ``tfds.testing.mock_data`` (random pixels, in memory like the real one) and ImageNet
as a synthetic array_record set of JPEGs at ImageNet's typical size (decode cost included),
marked in the 'source' column.

    python -m benchmarks.input_pipeline --cores=1,2,4,8,16

instead measures how the ImageNet pipeline scales with cores: images/s with N cores and N decode
workers (``data.num_workers``), per core, and the efficiency against the first count.
"""
from __future__ import annotations

from benchmarks import xla_flags

xla_flags.apply()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import io  # noqa: E402
import itertools  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import Any, Iterator, Sequence  # noqa: E402
from unittest import mock  # noqa: E402

import ml_collections  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import common  # noqa: E402
from normvit_jax import tool_flags  # noqa: E402
from configs import default  # noqa: E402
from normvit_jax import data  # noqa: E402
from normvit_jax.data import pipeline as pipeline_lib  # noqa: E402

DATASETS = ("digits", "cifar10", "cifar100", "imagenet2012")
CPU_STEP_BATCH = 128  # default cap of the step-rate batch on CPU (see step_batch)


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = tool_flags.Parser("python -m benchmarks.input_pipeline", __doc__)
    p.add_argument("--datasets", default="digits,cifar10,imagenet2012",
                   help=f"comma list of {list(DATASETS)}")
    p.add_argument("--data_dir", default=None, help="prepared tfds data (default: tfds's)")
    p.add_argument("--batch", type=tool_flags.positive_int, default=None,
                   help="default: the dataset config's")
    p.add_argument("--batches", type=tool_flags.positive_int, default=20,
                   help="timed pipeline batches")
    p.add_argument("--step_batch", type=tool_flags.positive_int, default=None,
                   help="batch for the step-rate measurement (default: --batch, at most "
                        f"{CPU_STEP_BATCH} on CPU)")
    p.add_argument("--steps", type=tool_flags.positive_int, default=3, help="timed train steps")
    p.add_argument("--model", default=None, help="override the dataset config's model preset")
    p.add_argument("--image_size", type=tool_flags.positive_int, default=None,
                   help="input resolution (default: 32 for a patch of at most 8, else 224)")
    p.add_argument("--depth", type=tool_flags.positive_int, default=None,
                   help="transformer blocks (default: the model preset's)")
    p.add_argument("--synthetic_examples", type=tool_flags.positive_int, default=256,
                   help="size of the synthetic ImageNet set when none is prepared")
    p.add_argument("--skip_run", action="store_true", help="skip the pipeline+step run")
    p.add_argument("--cores", default=None,
                   help="comma list of core counts, e.g. 1,2,4: ImageNet decode scaling instead of "
                        "the table above; each count runs the train pipeline alone in its own "
                        "process pinned to that many cores, with as many decode workers")
    p.add_argument("--antialias", action="store_true",
                   help="ImageNet with data.antialias=True (PIL's/timm's filter; the :imagenet "
                        "config and big_vision presets use False, DeiT presets True)")
    p.add_argument("--interpolation", default="bilinear", choices=["bilinear", "bicubic", "random"],
                   help="ImageNet's data.interpolation (DeiT presets: bicubic; T2T-ViT and "
                        "LearnableScaler: random)")
    p.add_argument("--pipeline_only", action="store_true",
                   help="measure the pipeline on the cores this process may use, with one decode "
                        "worker per core (what --cores runs in each child)")
    p.add_argument("--pin_cores", type=int, default=None,
                   help="with --pipeline_only: first restrict this process to its first N cores")
    p.add_argument("--xla_preset", default=xla_flags.DEFAULT_PRESET, choices=list(xla_flags.PRESETS),
                   help="XLA:CPU flags set before JAX starts: tuned (this project's measured "
                        "settings) or default (XLA's own); benchmarks/xla_flags.py")
    p.add_argument("--json", default=None, help="also write the results as JSON to this file")
    return p.parse_args(argv)


def dataset_config(name: str, args: argparse.Namespace) -> ml_collections.ConfigDict:
    c = default.get_config()
    if name == "digits":
        c = default.get_demo(c)
    elif name == "imagenet2012":
        c = default.get_imagenet(c)
        c.data.antialias = bool(args.antialias)
        c.data.interpolation = args.interpolation
    else:
        c.data.name = name
    c.data.data_dir = args.data_dir
    if args.batch:
        c.batch_size = args.batch
    if args.model:
        c.model.variant = args.model
    if args.image_size:
        c.data.image_size = args.image_size
    if args.depth:
        c.model.depth = args.depth
    return c


def _jpeg(rng: np.random.Generator, h: int, w: int) -> bytes:
    from PIL import Image
    # Smooth random colours plus grain, quality 90: ~105 kB per file at these sizes, close to the
    # ILSVRC2012 train JPEGs' mean (138 GB / 1.28 M files), so decoding costs about as much.
    small = rng.integers(0, 256, (h // 16 + 1, w // 16 + 1, 3), dtype=np.uint8)
    img = np.asarray(Image.fromarray(small).resize((w, h), Image.BILINEAR), np.float32)
    img = np.clip(img + rng.normal(0.0, 28.0, img.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def synthetic_imagenet(root: str, n: int) -> None:
    """An imagenet2012 array_record dataset of ``n`` synthetic JPEGs (400-500 x 333-375 px, the
    usual ImageNet sizes), prepared by tfds without downloading anything."""
    import tensorflow_datasets as tfds
    rng = np.random.default_rng(0)
    cls = type(tfds.builder("imagenet2012", data_dir=root))
    examples = [{"image": _jpeg(rng, int(rng.integers(333, 376)), int(rng.integers(400, 501))),
                 "label": int(i % 1000), "file_name": f"s{i}.JPEG"} for i in range(n)]

    def split_generators(self, dl_manager):
        return {"train": ((f"t{i}", ex) for i, ex in enumerate(examples)),
                "validation": ((f"v{i}", ex) for i, ex in enumerate(examples[:8]))}

    with mock.patch.object(cls, "_split_generators", split_generators):
        tfds.builder("imagenet2012", data_dir=root, file_format="array_record").download_and_prepare()


@contextlib.contextmanager
def open_train_pipeline(name: str, c: ml_collections.ConfigDict,
                        args: argparse.Namespace) -> Iterator[tuple[Any, str]]:
    """The train pipeline of ``name``: real data if prepared, else a stand-in (see the doc)."""
    try:
        p = data.make_pipeline(c, "train")
        yield p, "real" if name != "digits" else "bundled"
        p.close()
        return
    except data.DatasetNotFoundError:
        pass
    if name in ("cifar10", "cifar100"):
        import tensorflow_datasets as tfds
        with tempfile.TemporaryDirectory() as tmp:
            c.data.data_dir = tmp
            with tfds.testing.mock_data(num_examples=max(4 * c.batch_size, 512)):
                p = data.make_pipeline(c, "train")
            yield p, "tfds mock_data"
        return
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        synthetic_imagenet(tmp, max(args.synthetic_examples, c.batch_size))
        print(f"synthetic imagenet2012 prepared in {time.perf_counter() - t:.1f} s", file=sys.stderr)
        c.data.data_dir = tmp
        p = data.make_pipeline(c, "train")
        yield p, "synthetic JPEG"
        p.close()


def pipeline_rate(p: Any, batches: int) -> float:
    it = p.train_batches(0)
    next(it)  # thread start, first batch
    t = time.perf_counter()
    n = 0
    for b in itertools.islice(it, batches):
        n += len(b["label"])
    dt = time.perf_counter() - t
    it.close() if hasattr(it, "close") else None
    return n / dt


def step_batch(c: ml_collections.ConfigDict, args: argparse.Namespace) -> int:
    """--step_batch, else the config's batch, capped on CPU (ImageNet's 4,096 at 224 would need
    ~100 GB there): examples/s hardly depends on the batch once it fills the cores."""
    import jax
    if args.step_batch:
        return args.step_batch
    batch = int(c.batch_size)
    return min(batch, CPU_STEP_BATCH) if jax.default_backend() == "cpu" else batch


def step_rate(c: ml_collections.ConfigDict, args: argparse.Namespace) -> tuple[float, Any]:
    from normvit_jax.models import spec_of
    model = spec_of(c.model)
    cfg = common.bench_config(
        c.model.variant or "Ti/4", "layernorm", image_size=int(c.data.image_size),
        batch=step_batch(c, args), dtype=c.dtype,
        num_classes=data.resolve_data_spec(c).num_classes,
        model_overrides={k: getattr(model, k) for k in ("hidden_size", "depth", "num_heads",
                                                         "mlp_dim", "patch_size")})
    bench = common.compile_train("layernorm", cfg, num_classes=data.resolve_data_spec(c).num_classes)
    times = common.interleaved({"step": bench.step}, args.steps, warmup=1)["step"]
    return int(cfg.batch_size) / common.summarize(times).median, bench


def run_together(p: Any, bench: Any, steps: int) -> float:
    """Fraction of wall time spent waiting for the next batch while stepping (as the loop does).
    The step's batch shape may differ from the pipeline's; only the timing matters here."""
    it = p.train_batches(0)
    next(it)
    bench.step()
    wait = 0.0
    t0 = time.perf_counter()
    for _ in range(steps):
        t = time.perf_counter()
        next(it)
        wait += time.perf_counter() - t
        bench.step()
    total = time.perf_counter() - t0
    it.close() if hasattr(it, "close") else None
    return wait / total


def pipeline_only(args: argparse.Namespace) -> dict[str, Any]:
    """The ImageNet train pipeline alone, one decode worker per core this process may use."""
    if args.pin_cores:  # before TF starts: its thread pools and every later thread inherit it
        os.sched_setaffinity(0, pipeline_lib.usable_cores()[:args.pin_cores])
    n = len(pipeline_lib.usable_cores())
    c = dataset_config("imagenet2012", args)
    c.data.num_workers = n
    with open_train_pipeline("imagenet2012", c, args) as (p, source):
        rate = pipeline_rate(p, args.batches)
    row = {"cores": n, "workers": n, "source": source, "batch": int(c.batch_size),
           "antialias": bool(c.data.antialias), "interpolation": str(c.data.interpolation),
           "images_s": round(rate, 1), "images_s_per_core": round(rate / n, 1)}
    return {"machine": common.machine(), "args": vars(args), "rows": [row]}


def scaling(args: argparse.Namespace) -> dict[str, Any]:
    """``pipeline_only`` in a child process per core count, each pinned to its first N cores (so
    the Python reader and TF's decode threads all share those N cores)."""
    import json
    import subprocess
    cpus = pipeline_lib.usable_cores()
    try:
        counts = [int(v) for v in args.cores.split(",") if v.strip()]
    except ValueError:  # was a traceback
        counts = []
    # The documented --cores=1,2,4,8,16 on a smaller host: the counts it has, the rest named
    # (it was refused whole, so the README's command failed on most machines).
    over = [n for n in counts if n > len(cpus)]
    counts = [n for n in counts if n <= len(cpus)]
    if not counts or min(counts) < 1:
        raise SystemExit(f"--cores={args.cores}: each count must be in [1, {len(cpus)}]")
    if over:
        print(f"--cores: {over} left out: this process may use {len(cpus)} cores",
              file=sys.stderr, flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = args.data_dir
        if data_dir is None:
            data_dir = os.path.join(tmp, "data")
            batch = args.batch or int(dataset_config("imagenet2012", args).batch_size)
            synthetic_imagenet(data_dir, max(args.synthetic_examples, batch))
        for n in counts:
            out = os.path.join(tmp, f"{n}.json")
            cmd = [sys.executable, "-m", "benchmarks.input_pipeline", "--pipeline_only",
                   f"--pin_cores={n}", f"--data_dir={data_dir}", f"--batches={args.batches}",
                   f"--json={out}"]
            cmd += [f"--batch={args.batch}"] if args.batch else []
            cmd += ["--antialias"] if args.antialias else []
            cmd += [f"--interpolation={args.interpolation}"]
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            with open(out) as f:
                rows.append(json.load(f)["rows"][0])
            if args.data_dir is None:
                rows[-1]["source"] = "synthetic JPEG"
            print(f"{n} cores: {rows[-1]['images_s']:.0f} images/s", file=sys.stderr, flush=True)
    base = rows[0]["images_s_per_core"]
    for r in rows:
        r["efficiency"] = round(r["images_s_per_core"] / base, 2)
    return {"machine": common.machine(), "args": vars(args), "rows": rows, "cores_left_out": over}


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.pipeline_only:
        return pipeline_only(args)
    if args.cores:
        return scaling(args)
    names = [n.strip() for n in args.datasets.split(",") if n.strip()]
    bad = [n for n in names if n not in DATASETS]
    if bad:
        raise SystemExit(f"--datasets: unknown {bad}; accepted: {list(DATASETS)}")
    rows = []
    for name in names:
        c = dataset_config(name, args)
        with open_train_pipeline(name, c, args) as (p, source):
            pipe = pipeline_rate(p, args.batches)
            step, bench = step_rate(c, args)
            wait = None if args.skip_run else run_together(p, bench, args.steps)
        rows.append({"dataset": name, "source": source, "image": int(c.data.image_size),
                     "batch": int(c.batch_size), "step_batch": step_batch(c, args), "model": c.model.variant or "custom",
                     "pipeline_ex_s": round(pipe, 1), "step_ex_s": round(step, 1),
                     "headroom": round(pipe / step, 2),
                     "wait_fraction": None if wait is None else round(wait, 3),
                     "workers": c.data.num_workers or pipeline_lib.default_num_workers()})
        print(f"{name}: pipeline {pipe:.0f} ex/s, step {step:.0f} ex/s", file=sys.stderr, flush=True)
    return {"machine": common.machine(), "args": vars(args), "rows": rows}


def report(res: dict[str, Any]) -> str:
    if "cores" in res["rows"][0]:
        cols = ["cores", "workers", "source", "batch", "antialias", "interpolation", "images_s",
                "images_s_per_core", "efficiency"]
        over = res.get("cores_left_out")
        return ("ImageNet train pipeline alone (decode + random resized crop + flip + normalise), "
                "pinned to N cores; efficiency = per-core rate / the first row's\n"
                + common.table(res["rows"], cols)
                + (f"\nnot measured: {over} cores (more than this host gives the process)"
                   if over else ""))
    cols = ["dataset", "source", "image", "batch", "step_batch", "model", "workers", "pipeline_ex_s",
            "step_ex_s", "headroom", "wait_fraction"]
    return ("input pipeline vs train step (examples/s on this host; headroom = pipeline / step; "
            "wait_fraction: time in next(batches) while training)\n" + common.table(res["rows"], cols))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    return common.run_entry(parse, run, report, argv)


if __name__ == "__main__":
    main()
