"""The config of tests/test_own_data.py's two-process run: the tiny ViT on the prepared dataset
'tiny_own' in $NORMVIT_TEST_OWN_DATA_DIR; a global batch of 8 (4 devices, in one process or two),
3 steps (one epoch of 24 images), an eval over the 9 val images at the end; batches carry their
example indices (tests/fault_main.py records them)."""
import os

from tests.conftest import tiny_demo_config


def get_config():
    return tiny_demo_config(
        total_steps=3, log_every=1, checkpoint_every=3, eval_every=3, batch_size=8,
        eval_batch_size=4,
        **{"model.depth": 1, "model.hidden_size": 16, "model.mlp_dim": 32,
           "data.name": "tiny_own", "data.data_dir": os.environ["NORMVIT_TEST_OWN_DATA_DIR"],
           "data.image_size": 8, "data.normalize": "zscore", "data.num_workers": 1,
           "data.return_index": True})
