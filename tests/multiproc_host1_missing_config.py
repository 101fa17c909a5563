"""tests/test_multiprocess.py's start that fails on one process only: tests/multiproc_config.py,
except that process 1 names a prepared dataset its host does not have (as when the dataset was
prepared on a local disk of host 0 only). In --mode=eval its first failing check is now that the
run trained on another dataset (run_config.check_eval_dataset); either way process 1 alone fails."""
import os

from tests import multiproc_config


def get_config():
    c = multiproc_config.get_config()
    if os.environ.get("JAX_PROCESS_ID") == "1":
        c.data.name, c.data.data_dir = "only_on_host_0", "/nonexistent/normvit_test_data"
    return c
