"""An uploaded image file -> the artifact's input: decoded by the project's RGB rule
(``data.images``, docs/data.md), then the run's eval geometry (central crop of
``eval_crop_fraction``, resize to ``image_size``, or ``eval_resize_small``; ``data.transforms``),
rounded to uint8 as the JPEG eval pipeline rounds its resized pixels. Bad input raises
``InputError`` with the HTTP status and one line saying what is wrong."""
from __future__ import annotations

import io
import warnings

import numpy as np

from normvit_jax.data import images, transforms


class InputError(Exception):
    """A request the service refuses: ``status`` (4xx) and a one-line ``message``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def check_pixels(data: bytes, max_pixels: int) -> None:
    """Reads only the header: a file whose image is over ``max_pixels`` (a decompression bomb:
    a small file that decodes to a huge image) is refused before it is decoded."""
    from PIL import Image
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            with Image.open(io.BytesIO(data)) as im:
                w, h = im.size
        except Image.DecompressionBombError as e:
            raise InputError(413, f"image too large to decode: {e}") from None
        except Exception:  # noqa: BLE001  not an image: load_file names why
            return
    if w * h > max_pixels:
        raise InputError(413, f"image of {w}x{h} = {w * h:,} pixels is over the limit of "
                              f"{max_pixels:,} pixels (--max_pixels)")


def decode(data: bytes, max_pixels: int) -> np.ndarray:
    """Encoded file -> uint8 (H, W, 3) by the RGB rule."""
    if not data:
        raise InputError(400, "empty body: send one image file (raw body or multipart field "
                              "'file')")
    check_pixels(data, max_pixels)
    from PIL import Image
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            return images.load_file(data)[1]
        except images.BadImageError as e:
            raise InputError(400, f"not a readable image: {e}") from None


def to_input(rgb: np.ndarray, pre: dict) -> np.ndarray:
    """uint8 (H, W, 3) -> uint8 (image_size, image_size, 3) by the eval geometry ``pre`` (the
    artifact metadata's ``preprocess``). Crops before converting to float (large photos)."""
    size = int(pre["image_size"])
    interp = transforms.pick_interpolation(str(pre["interpolation"]), None)
    small = int(pre["eval_resize_small"])
    if not small:
        left, top, right, bottom = transforms.central_box(rgb.shape[0], rgb.shape[1],
                                                          float(pre["eval_crop_fraction"]))
        rgb = rgb[top:bottom, left:right]
    x = rgb[None].astype(np.float32) / np.float32(255.0)
    x = transforms.array_to_size(x, size, None, rrc=False, min_area=1.0, fraction=1.0,
                                 antialias=bool(pre["antialias"]),
                                 interpolation=interp, resize_small=small)
    return np.clip(np.rint(x[0] * 255.0), 0, 255).astype(np.uint8)
