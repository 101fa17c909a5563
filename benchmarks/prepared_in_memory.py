"""Train steps/s on a prepared dataset against the same images as arrays in memory (issue 35,
point 13), in one process, interleaved.

    python -m benchmarks.prepared_in_memory [--name=NAME --data_dir=DIR] [--images=3805]

Three pipelines over the same train split feed the run's own jitted train step (the loop's
``setup`` functions, donated state):
  arrays     the decoded split as an ``ArraySource`` (what CIFAR from tfds uses: float32 model
             input made on the host);
  prepared   the prepared dataset as a run opens it: decoded once into memory when it fits
             ``config.data.in_memory_mb`` (the default);
  decoding   the prepared dataset decoded again for every batch (``in_memory_mb=0``, the path
             before point 13).
Each round runs ``--block`` steps of every pipeline (order rotated per round); a step's time is
``next(batches)`` plus the step, synchronised. The first ``--skip`` steps of a block are dropped
(they eat batches the idle prefetch threads made ahead). Reported: median steps/s per pipeline and
the per-round ratio to ``arrays``. Without ``--name``: ``--images`` synthetic 32 px PNGs in 10
class folders, prepared in a temporary folder (PNG decoding, as the issue's CIFAR files).
"""
from __future__ import annotations

from benchmarks import xla_flags

xla_flags.apply()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import io  # noqa: E402
import os  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import Any, Iterator, Sequence  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import common  # noqa: E402
from normvit_jax import cli, data, sharding, tool_flags  # noqa: E402
from normvit_jax.data import pipeline as pipeline_lib  # noqa: E402
from normvit_jax.data import prepare  # noqa: E402
from normvit_jax.data.sources import ArraySource  # noqa: E402
from normvit_jax.train import optimizer as optim  # noqa: E402
from normvit_jax.train import setup  # noqa: E402

VARIANTS = ("arrays", "prepared", "decoding")


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = tool_flags.Parser("python -m benchmarks.prepared_in_memory", __doc__)
    p.add_argument("--config", default="configs/vit_dtn.py:demo",
                   help="the method config (the issue's measurement: vit_dtn.py:demo at 32 px)")
    p.add_argument("--name", default=None, help="a prepared dataset (default: synthetic PNGs)")
    p.add_argument("--data_dir", default=None,
                   help="where --name was prepared (default: $TFDS_DATA_DIR or "
                        "~/tensorflow_datasets)")
    p.add_argument("--images", type=tool_flags.positive_int, default=3805,
                   help="synthetic train images")
    p.add_argument("--batch", type=tool_flags.positive_int, default=128, help="global batch")
    p.add_argument("--rounds", type=tool_flags.positive_int, default=5,
                   help="timed rounds per mode")
    p.add_argument("--block", type=tool_flags.positive_int, default=20,
                   help="steps of one pipeline per round")
    p.add_argument("--skip", type=tool_flags.non_negative_int, default=6,
                   help="first steps of a block not counted")
    p.add_argument("--json", default=None, help="also write the results as JSON to this file")
    args = p.parse_args(argv)
    if args.skip >= args.block:  # no step of a block would be counted
        p.error(f"--skip={args.skip}: must be below --block={args.block}")
    return args


def synthetic_folder(root: str, n: int) -> None:
    """``n`` 32x32 PNGs (smooth colour fields plus grain) in 10 class folders."""
    from PIL import Image
    rng = np.random.default_rng(0)
    for i in range(n):
        d = os.path.join(root, f"class{i % 10}")
        os.makedirs(d, exist_ok=True)
        small = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)
        x = np.asarray(Image.fromarray(small).resize((32, 32), Image.BILINEAR), np.float32)
        x = np.clip(x + rng.normal(0, 20, x.shape), 0, 255).astype(np.uint8)
        Image.fromarray(x).save(os.path.join(d, f"{i}.png"))


@contextlib.contextmanager
def dataset(args: argparse.Namespace) -> Iterator[tuple[str, str | None]]:
    if args.name:
        yield args.name, args.data_dir
        return
    with tempfile.TemporaryDirectory() as tmp:
        synthetic_folder(os.path.join(tmp, "src"), args.images)
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            prepare.main([f"--src={tmp}/src", "--name=bench_small", f"--data_dir={tmp}/dd",
                          "--val_fraction=0"])
        yield "bench_small", f"{tmp}/dd"


def pipelines(c: Any, spec: Any) -> dict[str, Any]:
    prepared = data.make_pipeline(c, "train", spec, process_index=0, process_count=1)
    off = c.copy_and_resolve_references()
    off.data.in_memory_mb = 0
    decoding = data.make_pipeline(off, "train", spec, process_index=0, process_count=1)
    src = prepared.source
    if not hasattr(src, "images"):
        raise SystemExit("the prepared split was not decoded into memory: raise "
                         "--config.data.in_memory_mb or use a smaller dataset")
    arrays = pipeline_lib.Pipeline(c, spec, "train", ArraySource(src.images, src.labels), 0, 1)
    return {"arrays": arrays, "prepared": prepared, "decoding": decoding}


def run(args: argparse.Namespace) -> dict[str, Any]:
    with dataset(args) as (name, data_dir):
        c = cli.load_config_file(args.config)
        c.data.name, c.data.data_dir = name, data_dir
        c.data.eval_split = "train"  # only the train split is read here
        c.data.image_size, c.model.patch_size = 32, 4
        c.data.crop_padding, c.data.flip = 4, True
        c.batch_size, c.total_steps = args.batch, 10_000
        run_spec = setup.resolve_config(c)
        mesh = sharding.make_mesh(c)
        model = setup.create_model(c, run_spec.data.num_classes, run_spec.model)
        tx, lr = optim.create(c, int(c.total_steps))
        state, state_sharding = setup.create_train_state(model, tx, (32, 32, 3), mesh,
                                                         jax.random.key(0),
                                                         sharding.fsdp_min_size(c))
        step = setup.jit_train_step(setup.make_train_step(c, model, tx, lr, run_spec.data),
                                    state_sharding, mesh)
        pipes = pipelines(c, run_spec.data)
        its = {k: p.train_batches(0) for k, p in pipes.items()}
        holder = {"state": state}

        def block(name: str) -> list[float]:
            times = []
            for _ in range(args.block):
                t = time.perf_counter()
                batch = sharding.to_global(next(its[name]), mesh)
                holder["state"], m = step(holder["state"], batch)
                jax.block_until_ready((holder["state"], m))
                times.append(time.perf_counter() - t)
            return times[args.skip:]

        for name in VARIANTS:  # compile for float32 and uint8 batches, fill the queues
            block(name)
        per_round = common.interleaved({n: (lambda n=n: block(n)) for n in VARIANTS},
                                       args.rounds, warmup=0)
        for it in its.values():
            it.close()
        for p in pipes.values():
            p.close()
    rate = {n: [1.0 / float(np.median(ts)) for ts in per_round[n]] for n in VARIANTS}
    rows = []
    for n in VARIANTS:
        ratio = common.summarize([a / b for a, b in zip(rate[n], rate["arrays"])])
        steps_s = common.summarize(rate[n])
        rows.append({"pipeline": n, "steps_s": round(steps_s.median, 3),
                     "steps_s_p25_p75": f"{steps_s.lo:.3f}-{steps_s.hi:.3f}",
                     "vs_arrays": round(ratio.median, 3),
                     "vs_arrays_p25_p75": f"{ratio.lo:.3f}-{ratio.hi:.3f}"})
    return {"machine": common.machine(), "args": vars(args), "rows": rows}


def report(res: dict[str, Any]) -> str:
    cols = ["pipeline", "steps_s", "steps_s_p25_p75", "vs_arrays", "vs_arrays_p25_p75"]
    return ("train steps/s per pipeline (median over rounds of each block's median step), and "
            "per round / arrays'\n" + common.table(res["rows"], cols))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    return common.run_entry(parse, run, report, argv)


if __name__ == "__main__":
    main()
