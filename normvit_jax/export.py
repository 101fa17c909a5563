"""Writes a trained run's parameters as a Google vit_jax-layout .npz.

    python -m normvit_jax.export --workdir=runs/ft --out=model.npz [--step=N]

The file loads back with ``config.init_from`` and in other ViT codebases that read that format
(as the same model where the architecture is the standard pre-LN ViT; the log says where not).
"""
from __future__ import annotations

from typing import Any, Sequence

from absl import app, flags

from normvit_jax import models, pretrained

FLAGS = flags.FLAGS


def define_flags() -> None:
    """Defines the flags unless a module already did (main.py also defines --workdir)."""
    if "workdir" not in FLAGS:
        flags.DEFINE_string("workdir", None, "Run directory holding the checkpoints.")
    if "out" not in FLAGS:
        flags.DEFINE_string("out", None, "Output .npz path (local or gs://).")
    if "step" not in FLAGS:
        flags.DEFINE_integer("step", None, "Checkpoint step to export (default: the latest).")


def run(workdir: str, out: str, step: int | None = None) -> dict[str, Any]:
    from normvit_jax import checkpoints  # the train side's restore; imported late on purpose

    params, config = checkpoints.load_params(workdir, step=step)
    # a scanned run's stacked blocks are written per block (encoderblock_{i})
    return pretrained.export_npz(params, out, models.spec_of(config.model))


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {list(argv[1:])}")
    from normvit_jax import logs
    logs.quiet_library_logs()  # Orbax logs ~30 INFO lines per restore
    if not FLAGS.workdir or not FLAGS.out:
        raise app.UsageError("--workdir and --out are required")
    try:
        run(FLAGS.workdir, FLAGS.out, FLAGS.step)
    except pretrained.CheckpointError as e:  # a model the format cannot hold: a line, not a trace
        raise SystemExit(f"Stopped: {e}") from None


if __name__ == "__main__":
    define_flags()
    app.run(main)
