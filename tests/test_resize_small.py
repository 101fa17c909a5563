"""big_vision's evaluation ``resize_small(n)|central_crop(size)`` (data.eval_resize_small) on the
JPEG path (tf_images) and the array path (transforms) against a float64 numpy reference written
from the rule of google-research/big_vision @0127fb6 pp/ops_image.py:93-131, 268-292: the shorter
side to n (sides rounded), area resampling, truncation to uint8, the central crop."""
from __future__ import annotations

import io

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
from PIL import Image  # noqa: E402

from normvit_jax.data import tf_images, transforms  # noqa: E402
from normvit_jax.data.sources import Geometry  # noqa: E402


def _area_matrix(n_in: int, n_out: int) -> np.ndarray:
    """Output pixel o is the mean of the input over [o*s, (o+1)*s), s = n_in/n_out, each input
    pixel [i, i+1) weighted by its overlap: written as loops, in float64."""
    s = n_in / n_out
    m = np.zeros((n_out, n_in))
    for o in range(n_out):
        for i in range(n_in):
            m[o, i] = max(0.0, min(i + 1, (o + 1) * s) - max(i, o * s)) / s
    return m


def reference(img: np.ndarray, small: int, size: int, truncate: bool) -> np.ndarray:
    h, w = img.shape[:2]
    f = np.float32(small) / np.float32(min(h, w))
    nh, nw = int(np.round(np.float32(h) * f)), int(np.round(np.float32(w) * f))
    y = np.einsum("yh,hwc,xw->yxc", _area_matrix(h, nh), img.astype(np.float64), _area_matrix(w, nw))
    if truncate:
        y = np.floor(np.clip(y, 0, 255))
    top, left = (nh - size) // 2, (nw - size) // 2
    return y[top:top + size, left:left + size]


@pytest.mark.parametrize("shape", [(37, 53), (61, 29), (40, 40)])
def test_jpeg_path_is_big_vision_eval(shape):
    """PNG (lossless) so the decode is exact: TF's area resize in float32 may land 1 below or
    above the float64 reference only where the value is within 1e-3 of an integer."""
    img = np.random.default_rng(sum(shape)).integers(0, 256, shape + (3,), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG")
    geo = Geometry(16, False, 1.0, 0.875, resize_small=20)
    got = tf_images.BatchDecoder(1)([buf.getvalue()], None, geo)[0][0].astype(np.float64)
    want = reference(img, 20, 16, truncate=True)
    assert got.shape == (16, 16, 3)
    exact = reference(img, 20, 16, truncate=False)
    near_int = np.abs(exact - np.round(exact)) < 1e-3
    assert np.all((got == want) | (near_int & (np.abs(got - want) <= 1)))
    assert np.mean(got == want) > 0.99
    # not the crop-then-resize of data.eval_crop_fraction (what the presets did before)
    other = tf_images.BatchDecoder(1)([buf.getvalue()], None, Geometry(16, False, 1.0, 0.8))[0][0]
    assert np.mean(other == got) < 0.9


@pytest.mark.parametrize("shape", [(37, 53), (61, 29)])
def test_array_path_is_the_same_rule(shape):
    x = np.random.default_rng(1).random((2,) + shape + (3,)).astype(np.float32)
    got = transforms.array_to_size(x, 16, None, rrc=False, min_area=1.0, fraction=0.875,
                                   resize_small=20)
    for k in range(2):
        np.testing.assert_allclose(got[k], reference(x[k], 20, 16, truncate=False), rtol=1e-5,
                                   atol=1e-6)


def test_the_eval_pipeline_applies_the_key():
    """data.eval_resize_small reaches the eval batches (the digits' array path): 16 on 8x8 digits
    = the reference's 2x area upsampling, central 8 x 8, of the plain eval batch (the per-channel
    affine to model input commutes with the area average)."""
    from normvit_jax import data
    from tests.conftest import tiny_demo_config
    plain = tiny_demo_config(**{"data.num_eval_examples": 8})
    small = tiny_demo_config(**{"data.num_eval_examples": 8, "data.eval_resize_small": 16})
    a = data.make_pipeline(plain, "eval").eval_batch(0)["image"]
    b = data.make_pipeline(small, "eval").eval_batch(0)["image"]
    assert a.shape == b.shape == (64, 8, 8, a.shape[-1])
    for k in range(8):
        np.testing.assert_allclose(b[k], reference(a[k], 16, 8, truncate=False), rtol=1e-5,
                                   atol=1e-6)
    assert not np.allclose(a[:8], b[:8])
    from normvit_jax import predict  # predict decodes with the eval pipeline's geometry
    assert predict.eval_geometry(small.data).resize_small == 16
    assert predict.eval_geometry(plain.data).resize_small == 0


def test_a_side_smaller_than_the_crop_is_refused():
    from normvit_jax.data import dataspec
    from tests.conftest import tiny_demo_config
    c = tiny_demo_config(**{"data.eval_resize_small": 6})  # image_size 8
    with pytest.raises(ValueError, match=r"data.eval_resize_small=6.*>= data.image_size=8"):
        dataspec.validate(c)
