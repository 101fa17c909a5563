"""Writes a trained run's parameters as a Google vit_jax-layout .npz (``export_npz``; the layout
is ``models.google_layout``, loading it back ``normvit_jax.pretrained``), or the whole model as a
deployable artifact (``normvit_jax.deploy``, docs/deploy.md).

    python -m normvit_jax.export --workdir=runs/ft --out=model.npz [--step=N] [--weights=ema]
    python -m normvit_jax.export --workdir=W --format=onnx|savedmodel|stablehlo --out=PATH \
        [--fold] [--batch=N] [--folded=FOLDED_DIR] [--step=N] [--weights=ema]

The .npz loads back with ``config.init_from`` and in other ViT codebases that read that format
(as the same model where the architecture is the standard pre-LN ViT; the log says where not).
An artifact takes uint8 pixels ``image`` (N, H, W, 3) and gives ``probabilities`` and ``logits``;
``--fold`` folds the affine norms first (``normvit_jax.reparam``); ``classes.json`` is written
beside it. ``--weights=ema``: the weight EMA of a run trained with ``config.ema_decay > 0``
(``checkpoints.choose_weights``; the artifact's metadata ``source.weights`` says which).
Bad input (also a norm a format cannot express, a missing extra): one line, exit 2.
"""
from __future__ import annotations

import io
import os
import sys
from typing import Any, Callable, NoReturn, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from etils import epath
from flax import traverse_util
from flax.core import frozen_dict

from normvit_jax import models
from normvit_jax.models import scan_convert
from normvit_jax.models.google_layout import POSEMB, CheckpointError, check_family
from normvit_jax.models.spec import ViTSpec

FLAGS = flags.FLAGS


def _compat_notes(spec: ViTSpec) -> list[str]:
    """Where a model differs from the architecture other ViT codebases assume for this format."""
    notes = []
    names = {n["name"] for n in spec.slot_norms}
    if names != {"layernorm"}:
        notes.append(f"norms {sorted(names)} (others expect LayerNorm)")
    for key, want in (("norm_placement", "pre"), ("patch_norm", "none"), ("posemb", "learn"),
                      ("residual_scaling", "none"), ("cls_token_at_block", 0), ("final_norm", True),
                      ("gelu_approximate", True), ("qkv_bias", True)):
        if getattr(spec, key) != want:
            notes.append(f"model.{key}={getattr(spec, key)!r} (others assume {want!r})")
    if spec.classifier not in ("token", "gap"):  # *gap_fc_norm: the final norm after pooling
        notes.append(f"model.classifier={spec.classifier!r} (others assume 'token' or 'gap', the "
                     "final norm on the tokens as Transformer/encoder_norm)")
    return notes


def export_npz(params: Any, out_path: str, model: Any,
               log: Callable[[str], Any] | None = print) -> dict[str, np.ndarray]:
    """Writes ``params`` as a vit_jax-layout .npz (flat '/' names, per-block ``encoderblock_{i}``
    whatever ``model.scan``, float32, uncompressed) and returns the arrays written. ``model``: the
    ``ViTSpec`` or ``config.model``. Only parameters: a norm's running statistics (batch_stats)
    are not part of the format. The file is written beside the target and renamed, so a crash
    leaves no half file."""
    spec = models.spec_of(model)
    check_family(spec)
    tree = frozen_dict.unfreeze(params) if isinstance(params, frozen_dict.FrozenDict) else params
    if "params" in tree and "embedding" not in tree:
        tree = tree["params"]
    tree = scan_convert.unstack_blocks(tree)
    flat = {k: np.asarray(v) for k, v in traverse_util.flatten_dict(tree, sep="/").items()}
    if "embedding/kernel" not in flat or "head/kernel" not in flat:
        raise CheckpointError(f"not a ViT parameter tree (no embedding/kernel or head/kernel): "
                              f"{sorted(flat)[:8]}")
    pe = flat.get(POSEMB)
    if "cls" in flat and pe is not None and spec.cls_token_at_block:
        # The layout's rule: a class slot at index 0 iff the file has 'cls'. A model whose class
        # token joins without posemb (a late class token) gets a zero slot: loading folds it into
        # 'cls' exactly, and the patch grid is read as a grid.
        flat[POSEMB] = np.concatenate([np.zeros_like(pe[:, :1]), pe], 1)
    for k, v in flat.items():
        if jnp.issubdtype(v.dtype, jnp.floating) and v.dtype.itemsize < 4:
            flat[k] = v.astype(np.float32)  # bfloat16/float16 widen exactly
        elif v.dtype.kind not in "fiub":
            raise CheckpointError(f"parameter {k} has dtype {v.dtype}, not storable without pickle")
    out = epath.Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / (out.name + ".tmp")
    if "://" in str(out_path):  # object stores: build the archive in memory, upload once
        buf = io.BytesIO()
        np.savez(buf, **flat)
        tmp.write_bytes(buf.getvalue())
    else:
        with tmp.open("wb") as f:
            np.savez(f, **flat)
    tmp.replace(out)  # an existing file is replaced (as the deploy formats do); rename() refused it
    if log is not None:
        n = sum(v.size for v in flat.values())
        notes = _compat_notes(spec)
        log(f"exported {len(flat)} arrays ({n:,} values) to {out_path} in the vit_jax layout"
            + "".join(f"\n  note: {x}; loads back here, but other codebases will not build the same model"
                      for x in notes))
    return flat


def define_flags() -> None:
    """Defines the flags unless a module already did (main.py also defines --workdir)."""
    from normvit_jax import tool_flags
    if "workdir" not in FLAGS:
        flags.DEFINE_string("workdir", None, "Run directory holding the checkpoints.")
    if "out" not in FLAGS:
        flags.DEFINE_string("out", None, "Output path, per --format: npz: a .npz file (local or "
                            "gs://); onnx: a .onnx file; stablehlo: a .stablehlo file (those two "
                            "get classes.json and <out>.json beside them); savedmodel: a folder "
                            "(classes.json and deploy.json in it).")
    if "step" not in FLAGS:
        flags.DEFINE_integer("step", None, "Checkpoint step to export (default: the latest).")
    # --- deploy formats (normvit_jax.deploy, docs/deploy.md)
    if "weights" not in FLAGS:
        flags.DEFINE_enum("weights", None, list(tool_flags.WEIGHTS), tool_flags.WEIGHTS_HELP)
    if "format" not in FLAGS:
        flags.DEFINE_enum("format", "npz", ["npz", "onnx", "savedmodel", "stablehlo"],
                          "npz: the parameters (vit_jax layout); onnx, savedmodel, stablehlo: the "
                          "model with its input normalization and softmax (docs/deploy.md).")
    if "fold" not in FLAGS:
        flags.DEFINE_bool("fold", False, "Fold the affine norms into the next Dense first "
                          "(normvit_jax.reparam; its report is printed). Not for npz.")
    if "batch" not in FLAGS:
        flags.DEFINE_integer("batch", None, "Fixed batch size of the artifact (default: any).")
    if "folded" not in FLAGS:
        flags.DEFINE_string("folded", None, "A folder written by python -m normvit_jax.reparam "
                            "--out=...: export those folded weights (--workdir gives the data "
                            "settings and class names).")


# The suffix each format's --out is written with (docs/deploy.md); a SavedModel is a folder.
SUFFIXES = {"npz": ".npz", "onnx": ".onnx", "stablehlo": ".stablehlo"}


def check_out_suffix(out: str, fmt: str, fmt_given: bool = True) -> None:
    """Refuses an ``--out`` whose suffix names another format than ``fmt`` (``--out=m.onnx``
    without --format wrote an npz named m.onnx, which serve then failed to read): ValueError, one
    line (exit 2). Other suffixes (none, ``.bin``) are left to the user."""
    ext = os.path.splitext(out.rstrip("/"))[1].lower()
    named = next((f for f, s in SUFFIXES.items() if s == ext), None)
    if named is None or named == fmt:
        return
    chosen = f"--format is {fmt}" + ("" if fmt_given else " (the default)")
    if not fmt_given:
        fix = f"add --format={named}"
    elif fmt == "savedmodel":  # a folder: any name without another format's suffix
        fix = f"use --format={named}, or a folder name without {ext}"
    else:
        fix = f"use --format={named}, or an --out ending in {SUFFIXES[fmt]}"
    raise ValueError(f"--out={out} ends in {ext} but {chosen}: {fix}")


def run_deploy(workdir: str, out: str, fmt: str, *, step: int | None = None, fold: bool = False,
               batch: int | None = None, folded: str | None = None,
               weights: str | None = None) -> dict[str, Any]:
    """Writes the ``fmt`` artifact of a run (normvit_jax.deploy); returns its metadata."""
    from normvit_jax import deploy
    from normvit_jax.deploy import bundle
    if batch is not None and batch < 1:
        raise deploy.DeployError(f"--batch={batch}: must be >= 1 (leave it out for any batch)")
    if folded and step is not None:  # the folder is one model: --step was silently not used
        raise deploy.DeployError(
            f"--step={step} picks a checkpoint, but --folded={folded} exports the model that "
            f"folder holds; fold that step first: python -m normvit_jax.reparam "
            f"--workdir={workdir} --step={step} --out=DIR, then --folded=DIR without --step")
    if folded and weights:  # the folder holds one model, folded from the weights it records
        raise deploy.DeployError(
            f"--weights={weights} picks a checkpoint's weights, but --folded={folded} exports "
            f"the model that folder holds (its model.json says which weights); fold those "
            f"first: python -m normvit_jax.reparam --workdir={workdir} --weights={weights} "
            f"--out=DIR, then --folded=DIR without --weights")
    b = bundle.load(workdir, step=step, folded=folded, fold=fold, weights=weights)
    return deploy.export_artifact(b, fmt, out, batch)


def run(workdir: str, out: str, step: int | None = None,
        weights: str | None = None) -> dict[str, Any]:
    from normvit_jax import checkpoints  # the train side's restore; imported late on purpose

    # the shared restore path (checkpoints.restore_numpy): a damaged newest step falls back;
    # --weights: the raw or the EMA weights (checkpoints.choose_weights)
    variables, config, source = checkpoints.restore_weights(workdir, step, weights)
    # a scanned run's stacked blocks are written per block (encoderblock_{i}); the layout has no
    # place for metadata (other codebases read it), so the log says which weights it holds
    flat = export_npz(variables["params"], out, models.spec_of(config.model))
    print(f"  the {source['weights']} weights of step {source['step']} of {workdir}")
    note = running_statistics_note(variables, workdir, source["weights"])
    if note:
        print(note)
    return flat


def running_statistics_note(variables: dict, workdir: str, weights: str = "raw") -> str | None:
    """One line when the run keeps running statistics (BN, RepBN, UN, ...): the .npz format holds
    parameters only, so they are left out; reparam's folder (of the same ``weights``) keeps them."""
    n = len(jax.tree.leaves(variables.get("batch_stats", {})))
    if not n:
        return None
    return (f"  note: the .npz holds parameters only: the norms' {n} running-statistics arrays "
            f"(batch_stats) are left out, so the model it loads evaluates differently; `python -m "
            f"normvit_jax.reparam --workdir={workdir}{' --weights=ema' if weights == 'ema' else ''} "
            f"--out=DIR` writes a folder that keeps them (model.json + variables.msgpack, read by "
            f"predict --folded=DIR)")


def _stop(message: str) -> NoReturn:
    """One line on stderr, exit 2 (the project's CLI contract for bad input)."""
    print(f"python -m normvit_jax.export: error: {message}", file=sys.stderr)
    sys.exit(2)


def parse_flags(argv: list[str]) -> list[str]:
    """absl's parser with the one-line error of every tool (absl prints 'FATAL Flags parsing
    error' and exits 1 for a bad value or an unknown flag)."""
    try:
        return FLAGS(argv)
    except flags.Error as e:
        _stop(f"{e} (--help lists the flags)")


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        _stop(f"unexpected arguments: {list(argv[1:])} (--help lists the flags)")
    from normvit_jax import cli, logs, tool_flags
    logs.quiet_library_logs()  # Orbax logs ~30 INFO lines per restore
    if not FLAGS.workdir or not FLAGS.out:
        _stop("--workdir and --out are required (--help lists the flags)")
    with cli.tool_errors("python -m normvit_jax.export"):  # docs/faults.md: the table's codes
        check_out_suffix(FLAGS.out, FLAGS.format, FLAGS["format"].present)
        tool_flags.check_output("out", FLAGS.out, folder=FLAGS.format == "savedmodel")
        if FLAGS.format != "npz":
            run_deploy(FLAGS.workdir, FLAGS.out, FLAGS.format, step=FLAGS.step, fold=FLAGS.fold,
                       batch=FLAGS.batch, folded=FLAGS.folded, weights=FLAGS.weights)
            return
        if FLAGS.fold or FLAGS.batch is not None or FLAGS.folded:
            _stop("--fold, --batch and --folded apply to --format=onnx|savedmodel|stablehlo; the "
                  "npz holds the parameters as trained (python -m normvit_jax.reparam --out=DIR "
                  "folds)")
        run(FLAGS.workdir, FLAGS.out, FLAGS.step, FLAGS.weights)


if __name__ == "__main__":
    from normvit_jax import tool_flags
    define_flags()
    tool_flags.absl_help(sys.argv)  # help on stdout, exit 0 (absl: exit 1, and no -h)
    sys.argv = tool_flags.expand_home(sys.argv)  # --out=~/model.npz: ~ as after a space
    app.run(main, flags_parser=parse_flags)
