"""What an artifact is made of: a run's model, weights, input affine, eval geometry and class
names (``Bundle``), and the serving function every format converts (``serving_fn``).

``load`` is the only place the deploy code reads a checkpoint, through the project's one restore
path (``checkpoints.restore_numpy``, as predict, reparam and export --format=npz).
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable

import numpy as np

from normvit_jax.deploy.errors import DeployError

INPUT = "image"
OUTPUTS = ("probabilities", "logits")


@dataclasses.dataclass(frozen=True)
class Bundle:
    model: Any                    # the model's spec (folded or not)
    variables: dict               # {'params': ..., 'batch_stats': ...} as numpy arrays
    num_classes: int
    class_names: list[str]
    affine: tuple[np.ndarray, np.ndarray]  # model input = pixels / 255 * scale + shift
    image_size: int
    preprocess: dict              # the eval geometry serve applies before the artifact
    source: dict                  # provenance: workdir, step, norms, what was folded
    affine_in_weights: bool = False  # the affine folded into the patch embedding (--fold)


# How a file becomes the RGB uint8 pixels the geometry starts from (data/images.py, the RGB rule;
# docs/deploy.md): what a consumer outside this project must do to give the model the pixels it
# was evaluated on. tests/test_serve.py holds each value to what the project's decode does.
DECODE_RULES = {
    "orientation": "exif",  # EXIF Orientation (tag 274) applied: the pixels as a viewer shows them
    "frames": "first",  # animated GIF, WebP, APNG: the first frame only
    "alpha": "dropped",  # RGBA, LA, PA: the colour under each pixel kept, not composited
    "gray": "repeated",  # one channel (L, and 1-bit) copied to R, G and B
    "palette": "looked_up",  # P: each index's RGB colour
    "bit_depth_16": {"gray": "round(v * 255 / 65535)", "color": "v >> 8"},  # 16-bit PNG/TIFF
    "color_profile": "ignored",  # an ICC profile is not applied; CMYK by PIL's convert('RGB')
    "aspect_ratio": "kept",  # a central square crop (or the shorter side to eval_resize_small and
    # then a central crop) before the resize to image_size x image_size: never squashed
}


# How the RGB file is decoded and cut (data/tf_images.py; docs/deploy.md "outside the graph" has a
# TensorFlow reference that follows these; tests/test_serve.py holds it to the project's pixels).
# h, w: the image's height and width after DECODE_RULES; numbers in float64 unless said.
DECODER_RULES = {
    "files_kept": "an 8-bit RGB or gray JPEG or PNG, without transparency and without an EXIF "
                  "Orientation that turns it, is decoded as it is; any other file first becomes "
                  "the PNG of its RGB pixels by the decode rules",
    "jpeg": "only the crop window is decoded: tf.io.decode_and_crop_jpeg(data, [top, left, "
            "height, width], channels=3, dct_method='INTEGER_ACCURATE')",
    "other": "tf.io.decode_image(data, channels=3, expand_animations=False), then the crop "
             "window sliced",
    "rounding": "round() is round half to even (tf.round, Python's round)",
}


def geometry_rules(image_size: int, eval_crop_fraction: float, eval_resize_small: int,
                   interpolation: str, antialias: bool) -> dict:
    """The ``crop`` and ``resize`` rules of the metadata's ``preprocess`` for this geometry, as
    data/tf_images.py applies them (``interpolation`` 'random' evaluates bicubic,
    ``transforms.pick_interpolation``)."""
    if eval_resize_small:
        return {
            "crop": {"window": "the whole image: [0, 0, h, w]"},
            "resize": {
                "method": "area", "shorter_side_to": int(eval_resize_small),
                "size": "factor = float32(eval_resize_small) / float32(min(h, w)); "
                        "h2 = round(float32(h) * factor), w2 = round(float32(w) * factor) "
                        "(in float32)",
                "op": "tf.image.resize(x, [h2, w2], method='area')",
                "to_uint8": "clip(x, 0, 255), then truncated to uint8",
                "then": "the central image_size x image_size crop: top = (h2 - image_size) // 2, "
                        "left = (w2 - image_size) // 2"}}
    method = "bicubic" if interpolation in ("bicubic", "random") else "bilinear"
    op = ("tf.image.resize(x, [image_size, image_size], method='bilinear', antialias=antialias)"
          if method == "bilinear" else
          "tf.raw_ops.ScaleAndTranslate(images=float32(x)[None], size=[image_size, image_size], "
          "scale=float32(image_size) / float32([h', w']), translation=[0, 0], "
          "kernel_type='keyscubic', antialias=antialias)[0]")
    return {
        "crop": {"window": "[top, left, side, side]: side = max(round(eval_crop_fraction * "
                           "min(h, w)), 1); top = (h - side) // 2; left = (w - side) // 2"},
        "resize": {"method": method, "antialias": bool(antialias),
                   "op": op + " (x: the crop window's uint8 pixels, h' x w')",
                   "to_uint8": "clip(round(x), 0, 255)"}}


def eval_preprocess(data: Any) -> dict:
    """The eval pipeline's geometry (``predict.eval_geometry``) as plain JSON values, with the
    decoding rules (``decode``: DECODE_RULES; ``decoder``: DECODER_RULES) and the exact ``crop``
    and ``resize`` (``geometry_rules``); a key an older run's config.json lacks is
    configs/default.py's (``dataspec.setting``)."""
    from normvit_jax.data.dataspec import setting
    pre = {"image_size": int(data.image_size),
           "eval_crop_fraction": float(setting(data, "eval_crop_fraction")),
           "eval_resize_small": int(setting(data, "eval_resize_small") or 0),
           "interpolation": str(setting(data, "interpolation")),
           "antialias": bool(setting(data, "antialias")),
           "decode": json.loads(json.dumps(DECODE_RULES)),
           "decoder": dict(DECODER_RULES)}
    pre.update(geometry_rules(pre["image_size"], pre["eval_crop_fraction"],
                              pre["eval_resize_small"], pre["interpolation"], pre["antialias"]))
    return pre


def load(workdir: str, *, step: int | None = None, folded: str | None = None,
         fold: bool = False, log: Callable[[str], Any] | None = print,
         weights: str | None = None) -> Bundle:
    """The bundle of a run (``folded``: a folder written by ``reparam --out`` instead of the
    checkpoint; ``fold``: fold the affine norms first, as ``reparam`` does, the report logged;
    ``weights``: --weights, ``checkpoints.choose_weights``). The metadata's ``source`` records
    the step and which weights ('raw' or 'ema'; a folded folder's as its model.json says)."""
    from normvit_jax import checkpoints, models, predict, reparam
    config = checkpoints.load_config(workdir)
    source: dict = {"workdir": str(workdir)}
    if folded:
        try:
            model_cfg, variables, n = reparam.load(folded)
        except (FileNotFoundError, ValueError) as e:  # not (or a damaged) reparam --out folder: exit 2
            raise DeployError(str(e)) from None
        try:
            predict.check_folded(folded, n, workdir, config)
        except ValueError as e:
            raise DeployError(str(e)) from None
        model = models.spec_of(model_cfg, n)
        recorded = reparam.source_of(folded)
        source.update(folded_dir=str(folded), weights=recorded.get("weights", "raw"),
                      **{k: recorded[k] for k in ("step", "norm_statistics") if k in recorded})
    else:
        # the project's one restore path (checkpoints.restore_numpy): with step None the newest
        # that restores, a damaged newer one named in a warning; the step actually restored
        variables, config, record = checkpoints.restore_weights(workdir, step, weights)
        source.update(record)
        n = int(np.shape(variables["params"]["head"]["bias"])[-1])
        model = models.spec_of(config.model, n)
    return from_variables(config, model, variables, n, predict.class_names(workdir, config, n),
                          fold=fold, source=source, log=log, workdir=workdir)


def from_variables(config: Any, model: Any, variables: Any, num_classes: int,
                   class_names: list[str] | None = None, *, fold: bool = False,
                   source: dict | None = None, log: Callable[[str], Any] | None = print,
                   workdir: str | None = None) -> Bundle:
    """A bundle of given weights: ``config`` the run's (its ``data`` settings), ``model`` its
    spec or ``config.model``; ``workdir``: the run's, whose recorded input statistics
    (``run_data``) are used (without it, or for an older run, the dataset's)."""
    import jax
    from normvit_jax import models, reparam, run_data
    from normvit_jax.models import scan_convert
    n = int(num_classes)
    model = models.spec_of(model, n)
    variables = jax.tree.map(np.asarray, dict(variables))
    source = dict(source or {})
    if fold:
        try:
            model, variables, report = reparam.fold(model, variables)
        except ValueError as e:  # a norm placement that does not fold (post, sandwich)
            raise DeployError(f"--fold: {e}") from None
        model = models.spec_of(model, n)
        variables = jax.tree.map(np.asarray, variables)
        source.update(folded=list(report.folded), kept=[f"{s}: {why}" for s, why in report.kept])
        if log is not None:
            log(str(report))
    if getattr(model, "scan", False):  # blocks unrolled: jax2onnx cannot trace nn.scan's loop
        model = dataclasses.replace(model, scan=False)
        variables = jax.tree.map(np.asarray, scan_convert.to_layout(variables, model))
    # The residual stream's layout pin (models/stream_layout.py) picks training kernels on a GPU;
    # in an artifact it would be a LayoutConstraint custom call that jax.export refuses and
    # other runtimes lack. Values are the same without it.
    if getattr(model, "stream_layout", "free") != "free":
        model = dataclasses.replace(model, stream_layout="free")
    source["norms"] = sorted({str(c.get("name")) for c in getattr(model, "slot_norms", [])})
    affine = tuple(np.asarray(a, np.float32) for a in run_data.affine(workdir, config))
    in_weights = None
    if fold:  # the pixels' affine too: no normalizing ops on the whole image in the graph
        in_weights = reparam.fold_input_affine(model, variables, affine[0] / np.float32(255.0),
                                               affine[1])
        if in_weights is not None:
            variables = jax.tree.map(np.asarray, in_weights)
            source["input_affine"] = "folded into the patch embedding"
        if log is not None:  # the norms' report says nothing of it ("folded 0 norm slot(s)")
            log("folded the input normalization (x / 255 * scale + shift) into the patch "
                "embedding" if in_weights is not None else "kept the input normalization in "
                "the graph (a T2T-ViT stem or a norm on the raw patches: nothing to fold it into)")
    names = list(class_names or [str(i) for i in range(n)])
    return Bundle(model=model, variables=variables, num_classes=n, class_names=names,
                  affine=affine, image_size=int(config.data.image_size),
                  preprocess=eval_preprocess(config.data), source=source,
                  affine_in_weights=in_weights is not None)


def serving_fn(b: Bundle, with_variables: bool = False) -> Callable:
    """``image`` uint8 (N, H, W, 3) -> {'probabilities', 'logits'} float32 (N, classes): the
    model's eval forward after the run's input affine (``stats.model_input``, as predict and the
    eval step; with ``--fold`` it is in the patch embedding's weights instead,
    ``reparam.fold_input_affine``). ``with_variables``: a function of (variables, image) instead
    of closing over them (the SavedModel keeps them as TF variables)."""
    import jax
    from normvit_jax import models
    from normvit_jax.data import stats
    model = models.create(b.model, b.num_classes)

    def forward(variables: Any, image: Any) -> dict:
        x = image.astype(np.float32) if b.affine_in_weights else stats.model_input(image, b.affine)
        logits = model.apply(variables, x, train=False)
        logits = logits.astype(np.float32)
        return {"probabilities": jax.nn.softmax(logits, axis=-1), "logits": logits}

    if with_variables:
        return forward
    return lambda image: forward(b.variables, image)
