"""The config of tests/test_multiprocess.py's runs: the tests' tiny demo ViT shrunk further (one
block, 16 wide) so several processes start and trace quickly; a global batch of 16 (4 devices,
in one process or two) for 24 steps, a log line every 2 steps, a checkpoint every 4, an eval at
steps 12 and 24 over 100 test examples in batches of 32 (the last one padded); batches carry
their example indices (tests/fault_main.py records them)."""
from tests.conftest import tiny_demo_config


def get_config():
    return tiny_demo_config(total_steps=24, log_every=2, checkpoint_every=4, eval_every=12,
                            keep_checkpoints=3, batch_size=16, eval_batch_size=32,
                            **{"model.depth": 1, "model.hidden_size": 16, "model.mlp_dim": 32,
                               "data.num_eval_examples": 100, "data.return_index": True})
