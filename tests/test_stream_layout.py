"""models/stream_layout.py: model.stream_layout pins the residual stream row-major at every block
(on GPU by default); a layout constraint changes kernels, never values or gradients. What it does
to XLA:GPU's kernels is measured by benchmarks.gpu_hlo (docs/benchmarks.md), not here."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from normvit_jax import models
from normvit_jax.models import stream_layout


def test_auto_pins_on_gpu_only_and_row_major_always(monkeypatch):
    assert stream_layout.pinned("row_major") and not stream_layout.pinned("free")
    assert stream_layout.pinned("auto") == (jax.default_backend() == "gpu")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert stream_layout.pinned("auto")
    lowered = jax.jit(lambda v: stream_layout.pin(v * 2, "auto")).lower(jnp.ones((2, 3, 4)))
    assert "LayoutConstraint" in lowered.as_text()  # the constraint reaches the compiler


@pytest.mark.parametrize("layout", [{"norm_placement": "pre"}, {"norm_placement": "post"},
                                    {"norm_placement": "sandwich"},
                                    {"residual_scaling": "rescale", "final_norm": False},
                                    {"scan": True, "fusion_barriers": "on"}])
def test_pinned_stream_trains_to_the_same_loss_gradients_and_statistics(layout):
    """A ViT with the stream pinned row-major (every block layout: pre, post, sandwich, RescaleViT's
    residual, nn.scan with the CPU's fusion barriers) against the same ViT left to XLA: same loss,
    gradients and BatchNorm statistics, on random inputs with timm's init (a nonzero head)."""
    x = jax.random.normal(jax.random.key(0), (4, 8, 8, 3))
    cfg = {"variant": "Ti/4", "depth": 2, "hidden_size": 16, "num_heads": 2, "mlp_dim": 32,
           "param_init": "timm", "fusion_barriers": "off", "norm": {"name": "batchnorm"}, **layout}
    res = {}
    for setting in ("free", "row_major"):
        model = models.create({**cfg, "stream_layout": setting}, num_classes=4)
        variables = model.init(jax.random.key(1), x)
        if setting == "row_major":
            text = jax.jit(lambda v, m=model: m.apply(v, x)).lower(variables).as_text()
            assert text.count("LayoutConstraint") >= 2 * cfg["depth"] - 1 * bool(layout.get("scan"))

        def loss(p, m=model, v=variables):
            y, upd = m.apply({**v, "params": p}, x, train=True, mutable=["batch_stats"])
            return jnp.sum(jnp.sin(y)), upd
        (val, upd), g = jax.jit(jax.value_and_grad(loss, has_aux=True))(variables["params"])
        res[setting] = (val, g, upd)
    assert float(jnp.abs(res["free"][0])) > 0  # a nonzero loss: the comparison is not vacuous
    np.testing.assert_allclose(res["row_major"][0], res["free"][0], rtol=1e-6)
    # The constraint may change XLA:CPU's fusions and with them the order of float32 sums: every
    # gradient within 1e-5 of the largest gradient (some are analytically ~0, e.g. the bias of a
    # norm that another norm follows, and hold only rounding noise of ~1e-6 in both), the
    # statistics within 1e-5 of their own size.
    grads = [np.asarray(v, np.float64) for v in jax.tree.leaves(res["free"][1])]
    scale = max(float(np.max(np.abs(v))) for v in grads)
    for a, c in zip(jax.tree.leaves(res["row_major"][1]), grads):
        assert np.max(np.abs(np.asarray(a, np.float64) - c)) <= 1e-5 * scale
    for a, c in zip(jax.tree.leaves(res["row_major"][2]), jax.tree.leaves(res["free"][2])):
        np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-6)


def test_an_unknown_setting_is_refused_with_the_accepted_ones():
    with pytest.raises(ValueError, match=r"model.stream_layout='tokens_first' is not accepted; "
                                         r"accepted: \['auto', 'row_major', 'free'\]"):
        models.create({"variant": "Ti/4", "depth": 1, "stream_layout": "tokens_first"},
                      num_classes=4)
