"""The test run's shared JAX compilation cache (tests/conftest.py, _shared_compile_cache): on a
CPU-only machine this process uses it, and a child process that inherits the environment loads
what another child compiled, giving the same result."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import pytest

from tests.conftest import _cpu_only

# A program no other test compiles (its constant), and whether it came from the cache.
CHILD = """
import json, jax, jax.numpy as jnp
from jax import monitoring
hits = []
monitoring.register_event_listener(
    lambda name, **kw: hits.append(name) if name == "/jax/compilation_cache/cache_hits" else None)
f = jax.jit(lambda x: jnp.tanh(x @ x.T * 0.123456789) + jnp.sin(x))
y = f(jnp.arange(64.0).reshape(8, 8) / 64)
print(json.dumps({"hit": len(hits), "y": y.tolist()}))
"""


@pytest.mark.skipif(not _cpu_only(), reason="the shared cache is made on CPU-only machines")
def test_children_share_the_runs_compilation_cache():
    folder = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    assert folder and os.path.isdir(folder)
    assert jax.config.values["jax_compilation_cache_dir"] == folder
    runs = [json.loads(subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                                      check=True, timeout=300).stdout.splitlines()[-1])
            for _ in range(2)]
    assert runs[0]["hit"] == 0          # compiled by the first child
    assert runs[1]["hit"] >= 1          # and loaded by the second
    assert runs[1]["y"] == runs[0]["y"]  # and it computes the same, bit for bit
