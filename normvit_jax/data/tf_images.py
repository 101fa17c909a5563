"""JPEG decode, crop, resize and flip with TensorFlow ops, run by tf.data.

``BatchDecoder`` turns a batch of encoded images plus their rows of uniforms
(``order.aug_uniforms``) into the finished uint8 batch (the steps map it to model input,
``stats.model_input``). Each image goes through ``tf.data``'s parallel map on a private pool of
``workers`` threads (no GIL: the ops are TF's C++ kernels), in order, so the output is a pure
function of (bytes, uniforms, geometry). The crop window is computed from the uniforms by
``crop_window``, the same rule as ``transforms.random_resized_box``/``central_box`` (a test holds
them equal), and only that window is decoded (``tf.io.decode_and_crop_jpeg`` skips the rest).
Resizing is bilinear, with antialiasing when shrinking if ``geo.antialias`` (the filter of
``transforms.resize`` and of PIL; it costs as much as the decode itself) or plain (big_vision's
inception crop), and rounded to uint8 as a decoded image would be.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import threading
from typing import Any

import numpy as np

from normvit_jax import logs
from normvit_jax.data import transforms

_LOG_RATIO = tuple(math.log(r) for r in transforms.RRC_RATIO)
# One tf.function per (geometry, examples, workers) for the whole process, traced once under a
# lock before its first call: the batches in flight (sources.JpegSource: 4 threads) called it at
# once, each saw the tracing count change while the first call traced, and TF's frequent-tracing
# detector printed its "retracing" warning on every training run (tracing happened only once).
_FNS: dict[Any, Any] = {}
_FNS_LOCK = threading.Lock()


@functools.lru_cache(maxsize=None)
def _tf():
    logs.import_tensorflow_once()
    import tensorflow as tf
    # Only tf.data's CPU kernels are used: never let TF take an accelerator's memory.
    try:
        tf.config.set_visible_devices([], "GPU")
    except RuntimeError:  # already initialised; TF then keeps its earlier choice
        pass
    return tf


def crop_window(h: Any, w: Any, u: Any, geo: Any) -> Any:
    """int32 (top, left, height, width) of the crop of an ``h x w`` image, from its uniforms ``u``
    (float64, ``transforms.NUM_UNIFORMS``): random resized (``geo.rrc``; when no draw fits,
    ``transforms.rrc_fallback_box``) or central square."""
    tf = _tf()
    hf, wf = tf.cast(h, tf.float64), tf.cast(w, tf.float64)

    def central(fraction: float):
        side = tf.maximum(tf.round(fraction * tf.minimum(hf, wf)), 1.0)
        top, left = tf.math.floordiv(hf - side, 2.0), tf.math.floordiv(wf - side, 2.0)
        return tf.cast(tf.stack([top, left, side, side]), tf.int32)

    if not geo.rrc:
        if geo.resize_small:  # the whole image: _resize_small_crop crops after resizing
            return tf.cast(tf.stack([0.0, 0.0, hf, wf]), tf.int32)
        return central(geo.fraction)
    k = np.arange(transforms.RRC_ATTEMPTS)
    area = hf * wf * (geo.min_area + (1.0 - geo.min_area) * tf.gather(u, transforms.U_RRC + 2 * k))
    lo, hi = _LOG_RATIO
    ratio = tf.exp(lo + (hi - lo) * tf.gather(u, transforms.U_RRC + 2 * k + 1))
    cw, ch = tf.round(tf.sqrt(area * ratio)), tf.round(tf.sqrt(area / ratio))
    fits = (cw > 0) & (cw <= wf) & (ch > 0) & (ch <= hf)
    first = tf.argmax(tf.cast(fits, tf.int32))  # the first attempt that fits

    def random_box():
        ch1, cw1 = ch[first], cw[first]
        top = tf.minimum(tf.floor(u[transforms.U_POS_Y] * (hf - ch1 + 1)), hf - ch1)
        left = tf.minimum(tf.floor(u[transforms.U_POS_X] * (wf - cw1 + 1)), wf - cw1)
        return tf.cast(tf.stack([top, left, ch1, cw1]), tf.int32)

    def fallback():  # transforms.rrc_fallback_box
        r_lo, r_hi = transforms.RRC_RATIO
        in_ratio = wf / hf
        cw1 = tf.where(in_ratio > r_hi, tf.round(hf * r_hi), wf)
        ch1 = tf.where(in_ratio < r_lo, tf.round(wf / r_lo), hf)
        top, left = tf.math.floordiv(hf - ch1, 2.0), tf.math.floordiv(wf - cw1, 2.0)
        return tf.cast(tf.stack([top, left, ch1, cw1]), tf.int32)

    return tf.cond(tf.reduce_any(fits), random_box, fallback)


def _decode_window(encoded: Any, u: Any, geo: Any) -> Any:
    """uint8 (h, w, 3) of the crop window; JPEGs decode only the window."""
    tf = _tf()

    def jpeg():
        shape = tf.io.extract_jpeg_shape(encoded)
        win = crop_window(shape[0], shape[1], u, geo)
        # the accurate integer IDCT is PIL's (TF's default is the fast one); same speed with SIMD
        return tf.io.decode_and_crop_jpeg(encoded, win, channels=3, dct_method="INTEGER_ACCURATE")

    def other():  # PNG and friends (rare: tfds stores ImageNet as JPEG)
        img = tf.io.decode_image(encoded, channels=3, expand_animations=False)
        top, left, hh, ww = tf.unstack(crop_window(tf.shape(img)[0], tf.shape(img)[1], u, geo))
        return img[top:top + hh, left:left + ww]

    return tf.cond(tf.io.is_jpeg(encoded), jpeg, other)


def _resize(x: Any, geo: Any, interpolation: str) -> Any:
    tf = _tf()
    if interpolation == "bicubic":
        # Keys cubic (a = -0.5), taps outside the image dropped and the rest renormalised: PIL's
        # bicubic and transforms.resize, with or without the antialiasing stretch.
        hw = tf.cast(tf.shape(x)[:2], tf.float32)
        return tf.raw_ops.ScaleAndTranslate(
            images=tf.cast(x, tf.float32)[None], size=[geo.size, geo.size],
            scale=float(geo.size) / hw, translation=tf.zeros([2]), kernel_type="keyscubic",
            antialias=geo.antialias)[0]
    return tf.image.resize(x, [geo.size, geo.size], method="bilinear", antialias=geo.antialias)


def _resize_small_crop(x: Any, geo: Any) -> Any:
    """big_vision's eval ``resize_small(n)|central_crop(size)`` (big_vision @0127fb6
    pp/ops_image.py:93-131, 268-292): shorter side to n, sides rounded in float32, 'area'
    resampling, clipped and cast (truncated) to uint8, then the central crop."""
    tf = _tf()
    hw = tf.cast(tf.shape(x)[:2], tf.float32)
    factor = tf.cast(geo.resize_small, tf.float32) / tf.reduce_min(hw)
    new = tf.cast(tf.round(hw * factor), tf.int32)
    y = tf.cast(tf.clip_by_value(tf.image.resize(x, new, method="area"), 0.0, 255.0), tf.uint8)
    top, left = (new[0] - geo.size) // 2, (new[1] - geo.size) // 2
    return y[top:top + geo.size, left:left + geo.size]


def _finish_one(encoded: Any, u: Any, geo: Any) -> Any:
    """One image -> uint8 (size, size, 3): window, resize, then (train) pad-crop and flip."""
    tf = _tf()
    x = _decode_window(encoded, u, geo)
    if geo.resize_small and not geo.rrc:  # evaluation only: nothing follows
        return _resize_small_crop(x, geo)
    if geo.interpolation == "random":  # transforms.pick_interpolation
        x = tf.cond(u[transforms.U_INTERP] < 0.5, lambda: _resize(x, geo, "bilinear"),
                    lambda: _resize(x, geo, "bicubic"))
    else:
        x = _resize(x, geo, geo.interpolation)
    x = tf.cast(tf.clip_by_value(tf.round(x), 0.0, 255.0), tf.uint8)
    if geo.padding > 0:
        p, span = geo.padding, 2 * geo.padding + 1
        x = tf.pad(x, [[p, p], [p, p], [0, 0]])
        oy = tf.minimum(tf.cast(u[transforms.U_PAD_Y] * span, tf.int32), span - 1)
        ox = tf.minimum(tf.cast(u[transforms.U_PAD_X] * span, tf.int32), span - 1)
        x = x[oy:oy + geo.size, ox:ox + geo.size]
    if geo.flip:
        x = tf.cond(u[transforms.U_FLIP] < 0.5, lambda: tf.reverse(x, [1]), lambda: x)
    return x


def decode_error(encoded: bytes) -> str | None:
    """TensorFlow's reason (first line) why it cannot decode ``encoded`` whole, as training and
    evaluation decode it (``tf.io.decode_image``, 3 channels, first frame), or None if it can."""
    tf = _tf()
    try:
        tf.io.decode_image(encoded, channels=3, expand_animations=False)
    except tf.errors.OpError as e:
        return e.message.splitlines()[0] if e.message else type(e).__name__
    return None


class BadImageError(ValueError):
    """An image (or record) of the batch that TensorFlow cannot decode; ``position`` in the batch."""

    def __init__(self, position: int, reason: str):
        super().__init__(f"batch position {position}: {reason}")
        self.position, self.reason = position, reason


class BatchDecoder:
    """``decoder(encoded, u, geo) -> (uint8 (N, size, size, 3), int32 labels or None)``; one traced
    function per geometry, ``workers`` threads each (``data.num_workers``).

    ``encoded``: image bytes, or with ``examples=True`` whole serialized ``tf.train.Example``
    records (tfds's array_record files) whose 'image' and 'label' features are parsed in the graph,
    which leaves the Python side only the reads. The batch stays uint8: the train and eval steps map
    it to model input on the device (``stats.model_input``), which spares the host a float pass
    over every pixel and quarters the bytes sent to the device."""

    def __init__(self, workers: int):
        self.workers = max(1, int(workers))

    def _fn(self, geo: Any, examples: bool) -> Any:
        key = (geo, examples, self.workers)
        with _FNS_LOCK:
            if key not in _FNS:
                fn = self._make_fn(geo, examples)
                fn.get_concrete_function()  # the one trace, by its input signature
                _FNS[key] = fn
            return _FNS[key]

    def _make_fn(self, geo: Any, examples: bool) -> Any:
        tf = _tf()
        options = tf.data.Options()
        options.threading.private_threadpool_size = self.workers
        options.threading.max_intra_op_parallelism = 1
        options.deterministic = True
        spec = {"image": tf.io.FixedLenFeature([], tf.string),
                "label": tf.io.FixedLenFeature([], tf.int64)}

        @tf.function(input_signature=[tf.TensorSpec([None], tf.string),
                                      tf.TensorSpec([None, transforms.NUM_UNIFORMS], tf.float64)])
        def fn(encoded, u):
            labels = tf.zeros([0], tf.int32)
            if examples:
                parsed = tf.io.parse_example(encoded, spec)
                encoded, labels = parsed["image"], tf.cast(parsed["label"], tf.int32)
            ds = tf.data.Dataset.from_tensor_slices((encoded, u)).with_options(options)
            ds = ds.map(lambda e, r: _finish_one(e, r, geo), num_parallel_calls=self.workers,
                        deterministic=True)
            return ds.batch(tf.shape(encoded, out_type=tf.int64)[0]).get_single_element(), labels

        return fn

    def __call__(self, encoded: list[bytes], u: np.ndarray | None, geo: Any,
                 examples: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
        n = len(encoded)
        if n == 0:
            return (np.zeros((0, geo.size, geo.size, 3), np.uint8),
                    np.zeros(0, np.int32) if examples else None)
        if u is None:  # evaluation: no draws ('random' interpolation is then bicubic)
            u = np.zeros((n, transforms.NUM_UNIFORMS))
            geo = dataclasses.replace(
                geo, interpolation=transforms.pick_interpolation(geo.interpolation, None))
        fn = self._fn(geo, examples)
        enc, u = np.asarray(encoded, dtype=object), np.asarray(u, np.float64)
        try:
            x, labels = fn(enc, u)
        except _tf().errors.OpError:  # find the culprit, one by one, only on failure
            for k in range(n):
                try:
                    fn(enc[k:k + 1], u[k:k + 1])
                except _tf().errors.OpError as one:
                    raise BadImageError(k, one.message.splitlines()[0]) from None
            raise
        return x.numpy(), labels.numpy() if examples else None
