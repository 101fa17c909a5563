"""The config of the fault tests' runs of main.py: the tests' tiny demo ViT with one block (each
process traces less) for 24 steps, logging every 2 steps and checkpointing every 5 (so most
checkpoints fall between log steps), evaluating every 10; batches carry their example indices
(tests/fault_main.py records them)."""
from tests.conftest import tiny_demo_config


def get_config():
    return tiny_demo_config(total_steps=24, log_every=2, checkpoint_every=5, eval_every=10,
                            keep_checkpoints=3, **{"model.depth": 1, "data.return_index": True})
