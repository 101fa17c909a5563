"""train/setup.py: the init program draws its random numbers with JAX's GPU threefry kernel (the
same bits, compiled in seconds instead of XLA's inlined hash per parameter). Checked without a
GPU by lowering the real init program for CUDA: inside ``threefry_kernel()`` every threefry is
the kernel's custom call, outside none is; the flag is restored, and on CPU the state is the same
with and without it."""
from __future__ import annotations

import re

import jax
import numpy as np

from benchmarks import common
from normvit_jax import sharding
from normvit_jax.train import setup


def _init_program(norm: str):
    cfg = common.bench_config("Ti/4", norm, image_size=16, batch=4, depth=2)
    model = setup.create_model(cfg, 10)
    tx, _ = setup.optim.create(cfg, int(cfg.total_steps))
    return cfg, model, tx, jax.jit(setup.state_init(model, tx, (16, 16, 3)))


def _cuda_lowering(fn) -> str:
    return fn.trace(jax.random.key(0)).lower(lowering_platforms=("cuda",)).as_text()


def test_the_init_program_uses_the_threefry_kernel_on_gpu_only_inside():
    """The hash inlined is rotations (shift_left, shift_right, or) on every round; the kernel is
    one custom call per draw site: none of the hash's shifts left in the program."""
    _, _, _, init = _init_program("layernorm")
    inlined = _cuda_lowering(init)
    assert "cu_threefry2x32" not in inlined and inlined.count("stablehlo.shift_left") >= 20
    before = jax.config.jax_threefry_gpu_kernel_lowering
    with setup.threefry_kernel():
        _, _, _, init = _init_program("layernorm")  # traced anew: the flag is in the jit key
        kernel = _cuda_lowering(init)
    assert jax.config.jax_threefry_gpu_kernel_lowering == before
    assert re.search(r"custom_call @cu_threefry2x32", kernel), kernel[:2000]
    assert kernel.count("stablehlo.shift_left") == 0


def test_create_train_state_gives_the_same_state_with_the_kernel_flag():
    cfg, model, tx, _ = _init_program("dtn")
    mesh = sharding.make_mesh(cfg)
    state, _ = setup.create_train_state(model, tx, (16, 16, 3), mesh, jax.random.key(3))
    jitted = jax.jit(setup.state_init(model, tx, (16, 16, 3)))(jax.random.key(3))
    leaves = jax.tree.leaves(state.params)
    assert len(leaves) > 10 and max(float(np.abs(a).max()) for a in leaves) > 0.01
    for a, b in zip(leaves, jax.tree.leaves(jitted.params)):
        np.testing.assert_array_equal(a, b)


def test_create_train_state_compiles_its_init_inside_the_kernel_flag(monkeypatch):
    seen = []
    real = setup.threefry_kernel

    def recording():
        seen.append(jax.config.jax_threefry_gpu_kernel_lowering)
        return real()
    monkeypatch.setattr(setup, "threefry_kernel", recording)
    cfg, model, tx, _ = _init_program("layernorm")
    traced_with = []
    real_init = setup.state_init

    def spy(*a, **k):
        fn = real_init(*a, **k)

        def init(rng):
            traced_with.append(jax.config.jax_threefry_gpu_kernel_lowering)
            return fn(rng)
        return init
    monkeypatch.setattr(setup, "state_init", spy)
    setup.create_train_state(model, tx, (16, 16, 3), sharding.make_mesh(cfg), jax.random.key(0))
    assert seen and traced_with[-1] is True
