"""train/global_norm.py: the gradients' global norm with one reduction per leaf shape on a GPU/TPU,
optax's own on the CPU."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from normvit_jax.train import global_norm


def _tree(seed: int = 0) -> dict:
    """Leaves of four shapes, repeated as a ViT's blocks repeat them, at scales 1e-3 .. 1e2."""
    rng = np.random.default_rng(seed)
    tree = {}
    for i in range(5):
        tree[f"block_{i}"] = {
            "kernel": rng.normal(0, 10.0 ** (i - 3), (24, 40)).astype(np.float32),
            "bias": rng.normal(0, 1, (40,)).astype(np.float32),
            "qkv": rng.normal(0, 0.1, (24, 2, 12)).astype(np.float32)}
    tree["head"] = rng.normal(0, 100, (40, 7)).astype(np.float32)
    return tree


def _reduces(fn, tree) -> list[int]:
    """Operand counts of the reduce equations in ``fn``'s jaxpr."""
    eqns = jax.make_jaxpr(fn)(tree).eqns
    return sorted(len(e.invars) // 2 for e in eqns if e.primitive.name == "reduce")


def test_grouped_norm_is_the_float64_norm_with_one_reduce_per_shape():
    tree = _tree()
    want = np.sqrt(sum(np.sum(np.square(np.asarray(x, np.float64)))
                       for x in jax.tree.leaves(tree)))
    got = float(jax.jit(global_norm.grouped_norm)(tree))
    assert abs(got - want) <= 1e-6 * want, (got, want)
    # 5 kernels, 5 biases and 5 qkv leaves: one variadic reduce of 5 each; the head alone
    assert _reduces(global_norm.grouped_norm, tree) == [1, 5, 5, 5]
    assert len(jax.tree.leaves(tree)) == 16
    # bfloat16 leaves: their squares summed in float32 (a bfloat16 sum of 40 numbers of ~1e4
    # keeps 8 bits)
    half = jax.tree.map(lambda x: jnp.asarray(x, jnp.bfloat16), tree)
    want16 = np.sqrt(sum(np.sum(np.square(np.asarray(x, np.float64)))
                         for x in jax.tree.leaves(half)))
    got16 = float(jax.jit(global_norm.grouped_norm)(half))
    assert abs(got16 - want16) <= 1e-6 * want16, (got16, want16)


def test_on_the_cpu_the_norm_and_clip_are_optaxs_bit_for_bit():
    tree = _tree(1)
    assert jax.default_backend() == "cpu"
    assert float(jax.jit(global_norm.global_norm)(tree)) == float(jax.jit(optax.tree.norm)(tree))
    for max_norm in (0.5, 1e9):  # clipped and not
        ours = global_norm.clip_by_global_norm(max_norm)
        theirs = optax.clip_by_global_norm(max_norm)
        assert jax.tree.structure(ours.init(tree)) == jax.tree.structure(theirs.init(tree))
        a = jax.jit(lambda t: ours.update(t, ours.init(t))[0])(tree)
        b = jax.jit(lambda t: theirs.update(t, theirs.init(t))[0])(tree)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("max_norm", [0.5, 1e9])
def test_on_an_accelerator_the_clip_uses_the_grouped_norm(monkeypatch, max_norm):
    """With JAX's backend reported as 'gpu' (as benchmarks.gpu_hlo compiles the step) the clip
    reduces per shape and clips to max_norm / the float64 norm (or not at all)."""
    tree = _tree(2)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    tx = global_norm.clip_by_global_norm(max_norm)
    update = lambda t: tx.update(t, tx.init(t))[0]  # noqa: E731
    assert _reduces(update, tree) == [1, 5, 5, 5]
    norm = np.sqrt(sum(np.sum(np.square(np.asarray(x, np.float64))) for x in jax.tree.leaves(tree)))
    factor = min(1.0, max_norm / norm)
    assert factor < 1 or max_norm > norm
    for x, y in zip(jax.tree.leaves(update(tree)), jax.tree.leaves(tree)):
        np.testing.assert_allclose(x, np.asarray(y, np.float64) * factor, rtol=2e-6,
                                   atol=1e-30)


def test_the_train_step_logs_the_norm_it_clipped_with(monkeypatch):
    """steps._update's grad_norm is global_norm's: with the backend reported as 'gpu', the
    grouped norm (one computation, which XLA shares with the clip's)."""
    from normvit_jax.train import steps
    from normvit_jax.train.state import TrainState
    tree = _tree(3)
    tx = global_norm.clip_by_global_norm(1.0)
    state = TrainState.create(tree, {}, tx, jnp.zeros((2,), jnp.uint32))
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    _, grad_norm, finite = steps._update(state, tx, tree, {}, jnp.float32(1.0), False)
    assert bool(finite)
    assert float(grad_norm) == float(global_norm.grouped_norm(tree))
    # traced twice (the metric, the clip), computed once: XLA merges the two
    update = lambda t: steps._update(state, tx, t, {}, jnp.float32(1.0), False)[1]  # noqa: E731
    assert _reduces(update, tree) == [1, 1, 5, 5, 5, 5, 5, 5]
    assert jax.jit(update).lower(tree).compile().as_text().count("reduce(") == 4


_SHARDED = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
sys.path.insert(0, sys.argv[1])
from tests.test_global_norm import _tree
from normvit_jax.train import global_norm
tree = _tree(5)
mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "fsdp"))
def place(x):  # FSDP-like: the first axis that 4 divides split over 'fsdp'
    spec = [None] * x.ndim
    for i, n in enumerate(x.shape):
        if n % 4 == 0:
            spec[i] = "fsdp"
            break
    return jax.device_put(x, NamedSharding(mesh, P(*spec)))
sharded = jax.tree.map(place, tree)
jax.default_backend = lambda: "gpu"
got = float(jax.jit(global_norm.global_norm)(sharded))
want = float(np.sqrt(sum(np.sum(np.square(np.asarray(x, np.float64))) for x in jax.tree.leaves(tree))))
print(json.dumps({"got": got, "want": want, "devices": jax.device_count(),
                  "split": sum(len(x.sharding.device_set) > 1 and not x.sharding.is_fully_replicated
                               for x in jax.tree.leaves(sharded))}))
"""


def test_the_grouped_norm_of_parameters_sharded_over_devices():
    """Under FSDP the leaves are split over devices: the grouped reduce (one per shape, sharded
    operands) is partitioned by XLA and still gives the float64 norm (8 CPU devices)."""
    import json
    import os
    import subprocess
    import sys
    from tests.conftest import REPO_ROOT
    env = {**os.environ, "PYTHONPATH": REPO_ROOT, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    out = subprocess.run([sys.executable, "-c", _SHARDED, REPO_ROOT], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["devices"] == 8 and r["split"] >= 10, r
    assert abs(r["got"] - r["want"]) <= 1e-6 * r["want"], r
