"""Trains the deploy tests' runs: ``python tests/deploy_runs.py OUT_DIR method ...`` trains each
method's ``:demo`` config (configs/<method>.py) shrunk to one 32-wide block for 4 steps into
OUT_DIR/<method>. One process for all (one import of JAX and TensorFlow); the tests run it with
XLA's backend optimizations off, which halves the compile time that dominates such runs and
changes nothing the tests check (they compare artifacts with predict on the same checkpoint)."""
from __future__ import annotations

import importlib
import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def demo_config(method: str):
    """configs/<method>.py:demo, one 32-wide block (deeper where the demo places the class token
    counted from the end: DTN's -2 needs 3 blocks), 4 steps, a checkpoint at the end."""
    c = importlib.import_module(f"configs.{method}").get_config("demo")
    at = c.model.get("cls_token_at_block") or 0
    c.model.update(hidden_size=32, depth=max(1, 1 - at), num_heads=2, mlp_dim=64)
    c.update(total_steps=4, checkpoint_every=4, eval_every=4, log_every=4, eval_analysis_images=0)
    c.schedule.warmup_steps = 1
    c.optimizer.learning_rate = 1e-2  # a few steps that move the zero-initialised head enough
    # that the classes' probabilities differ by more than the tests' tolerance
    return c


def main(out: str, methods: list[str]) -> None:
    from normvit_jax.train import loop
    for m in methods:
        loop.train_and_evaluate(demo_config(m), os.path.join(out, m))


if __name__ == "__main__":
    sys.path.insert(0, REPO_ROOT)
    main(sys.argv[1], sys.argv[2:])
