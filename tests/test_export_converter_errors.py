"""A converter's own failure is one line and exit 2 (docs/deploy.md), not a traceback: a norm
written with ``jnp.power(v, -p)`` (a walker's ``soft_ln``) exported to ONNX with a dynamic batch
ended in ``TypeError: '_DimExpr' object cannot be interpreted as an integer`` from jax2onnx's pow
plugin (exit 1); ``--batch=N`` exports it."""
from __future__ import annotations

import json

import flax.linen as nn
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from normvit_jax.norms import registry
from normvit_jax.train import loop
from tests.conftest import tiny_demo_config
from tests.test_export_formats import _export_main as _export

pytestmark = pytest.mark.usefixtures("float32_matmuls")


class SoftLN(nn.Module):
    """y = (x - mean) / (var + eps)^power * scale + bias per token; no fold (a test-only norm)."""

    power: float = 0.5
    epsilon: float = 1e-5

    @nn.compact
    def __call__(self, x, train=False):
        c = x.shape[-1]
        scale = self.param("scale", nn.initializers.ones, (c,), jnp.float32)
        bias = self.param("bias", nn.initializers.zeros, (c,), jnp.float32)
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jnp.power(var + self.epsilon, -self.power)
        return (y * scale + bias).astype(x.dtype)


@pytest.fixture(scope="module")
def soft_ln_run(tmp_path_factory):
    """A 2-step tiny run whose every norm is SoftLN(power=0.4)."""
    mp = pytest.MonkeyPatch()
    mp.setitem(registry._ENTRIES, "soft_ln", f"{__name__}:SoftLN")
    c = tiny_demo_config(total_steps=2, eval_every=2, checkpoint_every=2, log_every=2)
    c.model.norm = ml_collections.ConfigDict({"name": "soft_ln", "power": 0.4})
    workdir = str(tmp_path_factory.mktemp("soft_ln") / "run")
    loop.train_and_evaluate(c, workdir)
    yield workdir
    mp.undo()


def test_a_converter_failure_is_one_line_naming_the_plugin_and_the_way_out(
        soft_ln_run, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(registry._ENTRIES, "soft_ln", f"{__name__}:SoftLN")
    monkeypatch.delenv("NORMVIT_TRACEBACK", raising=False)
    out = tmp_path / "x.onnx"
    code, _, err = _export([f"--workdir={soft_ln_run}", "--format=onnx", f"--out={out}"], capsys)
    assert code == 2 and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == (
        "python -m normvit_jax.export: error: --format=onnx: the converter failed on this model "
        "with a dynamic batch in jax2onnx.plugins.jax.numpy.pow (TypeError: '_DimExpr' object "
        "cannot be interpreted as an integer); export a fixed batch with --batch=N, or try "
        "another format (savedmodel, stablehlo); NORMVIT_TRACEBACK=1 shows the traceback")
    assert [line for line in err.splitlines() if "error" in line.lower()] == \
        [err.strip().splitlines()[-1]]
    assert not out.exists()

    # not swallowed: with NORMVIT_TRACEBACK the converter's own traceback comes first, same code
    monkeypatch.setenv("NORMVIT_TRACEBACK", "1")
    code, _, err = _export([f"--workdir={soft_ln_run}", "--format=onnx", f"--out={out}"], capsys)
    assert code == 2 and "Traceback" in err and "jax2onnx/plugins/jax/numpy/pow.py" in err
    assert "TypeError: '_DimExpr' object cannot be interpreted as an integer" in err


def test_the_way_out_works_a_fixed_batch_exports_and_runs(soft_ln_run, tmp_path, capsys,
                                                          monkeypatch):
    monkeypatch.setitem(registry._ENTRIES, "soft_ln", f"{__name__}:SoftLN")
    out = tmp_path / "x.onnx"
    code, stdout, err = _export([f"--workdir={soft_ln_run}", "--format=onnx", f"--out={out}",
                                 "--batch=6"], capsys)
    assert code == 0, err[-3000:]
    assert "exported the onnx artifact" in stdout
    import onnxruntime as ort
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    assert session.get_inputs()[0].shape == [6, 8, 8, 3]
    images = np.random.default_rng(0).integers(0, 256, (6, 8, 8, 3), dtype=np.uint8)
    names = [o.name for o in session.get_outputs()]
    probs = dict(zip(names, session.run(None, {"image": images})))["probabilities"]
    assert probs.shape == (6, 10)
    np.testing.assert_allclose(probs.sum(-1), 1.0, atol=1e-5)
    assert json.load(open(str(out) + ".json"))["input"]["shape"][0] == 6


def test_a_bug_in_the_models_own_code_stays_a_traceback():
    """Only an exception raised inside jax2onnx is the converter's: one raised in the traced
    code itself (here a TypeError of the function) is re-raised as it is (exit 1, a bug)."""
    import jax
    from jax import export as jax_export

    from normvit_jax.deploy import errors, onnx_format
    n = jax_export.symbolic_shape("N")[0]
    spec = jax.ShapeDtypeStruct((n, 4, 8), jnp.float32)

    def bug(x):
        return x + None
    with pytest.raises(TypeError, match="unsupported operand"):
        onnx_format.to_onnx(bug, [spec])

    def soft(x):
        return x * jnp.power(jnp.var(x, axis=-1, keepdims=True) + 1e-5, -0.4)
    with pytest.raises(errors.ConverterError) as e:
        onnx_format.to_onnx(soft, [spec])
    assert e.value.where == "jax2onnx.plugins.jax.numpy.pow" and isinstance(
        e.value.__cause__, TypeError)
    onnx_format.to_onnx(soft, [jax.ShapeDtypeStruct((6, 4, 8), jnp.float32)])  # a fixed batch
