"""The config of tests/test_multiprocess.py's runs: the tests' tiny demo ViT shrunk further (one
block, 16 wide) so four processes start and trace quickly; a global batch of 16 (4 devices, in
one process or two), a checkpoint every 2 steps, one eval at the end over 100 test examples in
batches of 32 (the last one padded); batches carry their example indices (tests/fault_main.py
records them)."""
from tests.conftest import tiny_demo_config


def get_config():
    return tiny_demo_config(total_steps=8, log_every=2, checkpoint_every=2, eval_every=8,
                            keep_checkpoints=10, batch_size=16, eval_batch_size=32,
                            **{"model.depth": 1, "model.hidden_size": 16, "model.mlp_dim": 32,
                               "data.num_eval_examples": 100, "data.return_index": True})
