"""An uploaded image file -> the artifact's input, exactly as ``python -m normvit_jax.predict``
and evaluation make it: decoded by the project's RGB rule (``data.images``, docs/data.md: a JPEG
or PNG that needs no change as it is, any other image through PIL, then its lossless PNG), then
TensorFlow's decoder and the run's eval geometry (``data.tf_images``: central crop of
``eval_crop_fraction``, resize to ``image_size``, or ``eval_resize_small``), uint8 out. PIL's full
decode with a numpy resize differed from it (TensorFlow decodes only the crop window of a JPEG,
and rounds its own resize): a pixel off by 1 to 20 levels, probabilities off by more than the
artifact's own error. Bad input raises ``InputError`` with the HTTP status and one line saying
what is wrong."""
from __future__ import annotations

import functools
import io
import warnings
from typing import Any

import numpy as np

from normvit_jax.data import images, transforms


class InputError(Exception):
    """A request the service refuses: ``status`` (4xx) and a one-line ``message``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def check_pixels(data: bytes, max_pixels: int, pre: dict | None = None,
                 limit: str = "--max_pixels", *, as_is: bool = True) -> None:
    """Reads only the header: a file whose image is over ``max_pixels`` (a decompression bomb:
    a small file that decodes to a huge image) is refused before it is decoded; with
    ``eval_resize_small`` in ``pre``, so is one whose resized image would be (a 3 x 10000 strip
    resized to a short side of 256 is 256 x 853,333). limit: what sets max_pixels, in the
    message (serve's flag; predict's fixed limit). as_is=False checks only the resized size
    (predict: a large photo on disk is the user's own, only a resize that explodes is refused;
    load_file refuses one over images.MAX_FILE_PIXELS, 250 MP)."""
    Image, _ = images._pil()  # pylint: disable=protected-access  (PIL's limit: MAX_FILE_PIXELS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            with Image.open(io.BytesIO(data)) as im:
                w, h = im.size
        except Image.DecompressionBombError as e:
            raise InputError(413, f"image too large to decode: {e}") from None
        except Exception:  # noqa: BLE001  not an image: the decoding names why
            return
    if as_is and w * h > max_pixels:
        raise InputError(413, f"image of {w}x{h} = {w * h:,} pixels is over the limit of "
                              f"{max_pixels:,} pixels ({limit})")
    small = int((pre or {}).get("eval_resize_small") or 0)
    if small:  # the sides as tf_images._resize_small_crop rounds them (float32)
        factor = np.float32(small) / np.float32(min(h, w))
        nh, nw = int(np.round(np.float32(h) * factor)), int(np.round(np.float32(w) * factor))
        if nh * nw > max_pixels:
            raise InputError(413, f"image of {w}x{h} is resized to {nw}x{nh} = {nw * nh:,} "
                                  f"pixels (eval_resize_small={small}), over the limit of "
                                  f"{max_pixels:,} pixels ({limit})")


def geometry(pre: dict) -> Any:
    """The metadata's ``preprocess`` -> the eval ``Geometry`` (``predict.eval_geometry`` of the
    run's config: bundle.eval_preprocess writes these keys from it)."""
    from normvit_jax.data.sources import Geometry
    return Geometry(int(pre["image_size"]), False, 1.0, float(pre["eval_crop_fraction"]),
                    antialias=bool(pre["antialias"]),
                    interpolation=transforms.pick_interpolation(str(pre["interpolation"]), None),
                    resize_small=int(pre["eval_resize_small"] or 0))


@functools.lru_cache(maxsize=1)
def _decoder() -> Any:
    from normvit_jax.data import tf_images
    return tf_images.BatchDecoder(1)  # one image per request; requests run in parallel


def to_input(data: bytes, pre: dict, max_pixels: int) -> np.ndarray:
    """Encoded file -> uint8 (image_size, image_size, 3): predict's pixels for the same file."""
    from PIL import Image
    from normvit_jax.data import tf_images
    if not data:
        raise InputError(400, "empty body: send one image file (raw body or multipart field "
                              "'file')")
    check_pixels(data, max_pixels, pre)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            encoded = images.as_stored(data)
        except images.BadImageError as e:
            raise InputError(400, f"not a readable image: {e}") from None
    try:
        x, _ = _decoder()([encoded], None, geometry(pre))
    except tf_images.BadImageError:  # a truncated JPEG; a PNG cut short, which PIL reads
        raise InputError(400, f"not a readable image: {images.undecodable(data)}") from None
    return x[0]
