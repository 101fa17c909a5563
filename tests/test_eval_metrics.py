"""The eval metrics (train/steps.make_eval_step summed by train/setup.evaluate) against an
independent numpy float64 reference on random logits: timm's ``accuracy`` (top-k over
``min(k, classes)`` of a descending sort; equal logits: the lower class index first, the rule of
``jnp.argmax`` and ``jax.lax.top_k``), plain cross-entropy averaged per real example over all
batches (no label smoothing, as timm's validate), padded rows left out even when their logits
are NaN, and big_vision's ReaL top-1 (empty label sets not scored)."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from normvit_jax import evaluation, sharding
from normvit_jax.data import real
from normvit_jax.train import setup
from normvit_jax.train.state import TrainState


class _Logits(nn.Module):
    """The batch's 'image' is the logits (times a parameter that stays 1)."""

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        return x * self.param("one", nn.initializers.ones, ())


def _reference(logits: np.ndarray, labels: np.ndarray, sets: list[np.ndarray]) -> dict:
    """float64 numpy, written from the published rules, one real example per row."""
    x = logits.astype(np.float64)
    m = x.max(-1, keepdims=True)
    lse = np.log(np.exp(x - m).sum(-1)) + m[:, 0]
    loss = lse - x[np.arange(len(x)), labels]
    order = np.argsort(-x, axis=-1, kind="stable")  # ties: lower index first
    k = min(5, x.shape[-1])
    top1 = order[:, 0] == labels
    top5 = (order[:, :k] == labels[:, None]).any(-1)
    scored = [i for i, s in enumerate(sets) if len(s)]
    real_hits = sum(int(order[i, 0] in set(sets[i].tolist())) for i in scored)
    return {"loss": loss.mean(), "top1": top1.mean(), "top5": top5.mean(),
            "num_examples": len(x), "real_top1": real_hits / len(scored),
            "real_num_examples": len(scored)}


def _tied_logits(rng: np.random.Generator, n: int, classes: int) -> tuple[np.ndarray, np.ndarray]:
    """Random logits on a coarse grid (many equal values), a third of the rows with the label
    tied to the row's maximum at a random place (so the tie rule decides top-1 and top-5)."""
    x = np.round(rng.normal(0, 1.5, (n, classes)) * 2) / 2 + 0.0  # + 0.0: no -0.0 (top_k
    # orders it below +0.0, a total order; numpy and argmax call them equal)
    y = rng.integers(0, classes, n)
    tie = rng.random(n) < 1 / 3
    x[tie, y[tie]] = x[tie].max(-1)
    x[rng.integers(0, n)] = 0.5  # one row all equal
    return x.astype(np.float32), y.astype(np.int32)


@pytest.mark.parametrize("classes", [3, 10])
def test_eval_metrics_match_numpy_over_an_uneven_split(classes):
    rng = np.random.default_rng(classes)
    n, batch = 37, 8  # 5 batches, the last one 5 real rows + 3 padded
    logits, labels = _tied_logits(rng, n, classes)
    ties = (logits == logits.max(-1, keepdims=True)).sum(-1) > 1
    assert ties.sum() >= 5  # the tie rule is exercised
    sets = [rng.choice(classes, rng.integers(0, 3), replace=False) for _ in range(n)]
    batches = []
    for b in range(0, n, batch):
        rows = np.arange(b, b + batch)
        real_rows = rows < n
        x = np.full((batch, classes), np.nan, np.float32)  # padded rows: NaN logits
        y = np.zeros(batch, np.int32)
        x[real_rows], y[real_rows] = logits[rows[real_rows]], labels[rows[real_rows]]
        pad_sets = [sets[i] if i < n else np.arange(classes) for i in rows]
        batches.append({"image": x, "label": y, "mask": real_rows.astype(np.float32),
                        "real": real.multi_hot(pad_sets, classes)})

    class Split:
        def eval_batches(self):
            return iter(batches)

    mdl = _Logits()
    params = mdl.init(jax.random.key(0), jnp.zeros((1, classes)))["params"]
    state = TrainState.create(params, {}, optax.sgd(0.1), jax.random.key_data(jax.random.key(1)))
    mesh = sharding.make_mesh()
    rep = jax.tree.map(lambda _: sharding.replicated(mesh), state)
    step = setup.jit_eval_step(mdl, rep, mesh, None, evaluation.real_sums)
    got = evaluation._with_real_top1(setup.evaluate(step, state, Split(), mesh))
    want = _reference(logits, labels, sets)
    assert got["num_examples"] == n and got["real_num_examples"] == want["real_num_examples"]
    for key in ("top1", "top5", "real_top1"):  # counts over n: exact up to float32 division
        np.testing.assert_allclose(got[key], want[key], rtol=1e-6, err_msg=key)
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
    if classes < 5:  # timm: k = min(5, classes), every label is in the top 'five'
        assert got["top5"] == 1.0


def _nan(negative: bool) -> np.float32:
    """A quiet NaN; with the sign bit (x86's default NaN, what inf - inf gives there)."""
    return np.array([0xFFC00000 if negative else 0x7FC00000], np.uint32).view(np.float32)[0]


def test_nan_and_signed_zero_logits_rank_as_argmax_and_timm_rank_them():
    """A NaN logit ranks first whatever its sign bit (jnp.argmax, big_vision's top-1; torch.topk,
    timm's accuracy) and -0.0 ties +0.0, in top-5 as in top-1: a row is never a top-1 hit and a
    top-5 miss. jax.lax.top_k's total order put a sign-bit NaN last and -0.0 below +0.0."""
    rng = np.random.default_rng(7)
    x = rng.normal(0, 1, (6, 8)).astype(np.float32)
    y = rng.integers(0, 8, 6).astype(np.int32)
    x[0, 3], y[0] = _nan(True), 3               # the row's prediction is its NaN class
    x[1, 5], x[1, 2], y[1] = _nan(True), _nan(False), 5  # the first NaN (class 2) is the prediction
    x[2], x[2, 0], y[2] = 0.0, -0.0, 0          # an 8-way tie of zeros, -0.0 first: class 0 leads
    x[3], x[3, 1], y[3] = -0.0, 0.0, 7          # all zeros: classes 0..4 are the top five
    batch = {"image": x, "label": y, "mask": np.ones(6, np.float32)}
    mdl = _Logits()
    params = mdl.init(jax.random.key(0), jnp.zeros((1, 8)))["params"]
    state = TrainState.create(params, {}, optax.sgd(0.1), jax.random.key_data(jax.random.key(1)))
    mesh = sharding.make_mesh()
    rep = jax.tree.map(lambda _: sharding.replicated(mesh), state)
    got = setup.jit_eval_step(mdl, rep, mesh)(state, batch).compute()
    # reference: NaN first (lower index first among NaNs), then descending, ties by index
    nan = np.isnan(x)
    order = np.lexsort((np.where(nan, 0.0, -x.astype(np.float64)), ~nan), axis=-1)
    top1 = order[:, 0] == y
    top5 = (order[:, :5] == y[:, None]).any(-1)
    assert top1[:4].tolist() == [True, False, True, False]  # the rows test what they say
    assert top5[:4].tolist() == [True, True, True, False]
    np.testing.assert_allclose(float(got["top1"]), top1.mean(), rtol=1e-6)
    np.testing.assert_allclose(float(got["top5"]), top5.mean(), rtol=1e-6)
