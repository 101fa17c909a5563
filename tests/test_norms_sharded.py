"""Batch statistics under a jit with the batch sharded over a 'data' mesh axis of 8 CPU devices.

Runs in a subprocess so that the 8-device XLA flag never touches other test modules. Checks, for
batchnorm, powernorm and unified over three steps (past their warmups): the sharded outputs,
gradients and new batch_stats equal the single-device (global statistics) ones; with
stats_group_size each ghost group is normalised exactly as if run alone.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from tests.deploy_runs import XLA_FAST

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent(r'''
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from normvit_jax import norms
    from normvit_jax.norms.gradient_rule import train_grads

    assert jax.device_count() == 8, jax.devices()
    mesh = Mesh(np.array(jax.devices()), ("data",))
    batch_sharded, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    rng = np.random.default_rng(0)
    xs = [(rng.normal(size=(16, 5, 8)) * rng.uniform(0.5, 2, 8) + 0.3).astype(np.float32)
          for _ in range(3)]
    ws = [rng.normal(size=(16, 5, 8)).astype(np.float32) for _ in range(3)]

    def rel(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))

    def make_step(module):
        def step(params, stats, x, w):
            loss, grads, new, y = train_grads(
                lambda v: module.apply(v, x, train=True, mutable=["batch_stats"]), params, stats,
                lambda y: jnp.sum(w * y))
            return y, grads, new
        return step

    CASES = [("batchnorm", {}), ("powernorm", {"warmup": 2}),
             ("unified", {"warmup": 2, "window": 2, "ratio_warmup": 2})]
    for name, opts in CASES:
        module = norms.create({"name": name, **opts}, dim=8, num_heads=2)
        v = module.init(jax.random.PRNGKey(0), jnp.asarray(xs[0]), train=True)
        step = make_step(module)
        single = jax.jit(step)
        sharded = jax.jit(step, in_shardings=(replicated, replicated, batch_sharded, batch_sharded),
                          out_shardings=(batch_sharded, replicated, replicated))
        s1 = s2 = v["batch_stats"]
        for i, (x, w) in enumerate(zip(xs, ws)):
            y1, g1, s1 = single(v["params"], s1, jnp.asarray(x), jnp.asarray(w))
            y2, g2, s2 = sharded(v["params"], s2, jax.device_put(x, batch_sharded),
                                 jax.device_put(w, batch_sharded))
            assert len(y2.sharding.device_set) == 8
            errs = [rel(y2, y1)] + [rel(a, b) for a, b in zip(jax.tree.leaves(g2), jax.tree.leaves(g1))]
            errs += [rel(a, b) for a, b in zip(jax.tree.leaves(s2), jax.tree.leaves(s1))]
            assert max(errs) <= 1e-5, (name, i, errs)
        # Ghost batches: each group of 2 samples normalised as if it ran alone (fresh state).
        ghost = norms.create({"name": name, "stats_group_size": 2, **opts}, dim=8, num_heads=2)
        run = lambda m, xx: m.apply(v, xx, train=True, mutable=["batch_stats"])[0]
        y = jax.jit(lambda xx: run(ghost, xx), in_shardings=batch_sharded)(
            jax.device_put(xs[0], batch_sharded))
        for g in range(8):
            alone = run(module, jnp.asarray(xs[0][2 * g:2 * g + 2]))
            assert rel(y[2 * g:2 * g + 2], alone) <= 1e-5, (name, "ghost group", g)
        print(name, "ok")
    print("ALL OK")
''')


def test_sharded_batch_statistics(tmp_path):
    script = tmp_path / "sharded_norms.py"
    script.write_text(SCRIPT)
    # XLA's backend optimizations off (tests/deploy_runs.XLA_FAST): compiles 3-6x faster; the
    # sharded and single-device results are compiled alike
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8 " + XLA_FAST,
               JAX_PLATFORMS="cpu", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "ALL OK" in proc.stdout, proc.stdout + proc.stderr[-3000:]
