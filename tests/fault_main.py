"""Runs main.py unchanged, with two test-only instruments switched on by environment variables:

NORMVIT_TEST_RECORD=path       appends one line per train batch the loop consumes: its example
                               indices (config.data.return_index), to check the data order;
                               "{process}" in the path becomes jax.process_index().
NORMVIT_TEST_RECORD_EVAL=path  the same for eval batches: the indices of their real (unpadded)
                               rows, one line per batch.
NORMVIT_TEST_HOLD_COMMIT=secs  every Orbax checkpoint waits that long before its atomic rename,
                               so a test can SIGKILL the run while a checkpoint is half-written.
NORMVIT_TEST_WORKDIR_WAIT_S=s  how long a process looks for process 0's probe in the workdir
                               (distributed.check_shared_workdir; 10 s), so a test of a workdir
                               that one process does not see need not wait the whole 10 s.

The faults themselves (signals, truncated files, read-only dirs, ...) come from the test.
"""
import asyncio
import os
import runpy
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _record(train_path: str | None, eval_path: str | None) -> None:
    import jax
    import numpy as np
    from normvit_jax import sharding

    to_global = sharding.to_global

    def recording(batch, mesh):
        path = eval_path if "mask" in batch else train_path
        if "index" in batch and path:
            index = np.asarray(batch["index"])
            with open(path.format(process=jax.process_index()), "a") as f:
                f.write(" ".join(map(str, index[index >= 0].tolist())) + "\n")
        return to_global(batch, mesh)

    sharding.to_global = recording


def _hold_commits(seconds: float) -> None:
    from orbax.checkpoint._src.path import atomicity

    finalize = atomicity.AtomicRenameTemporaryPath.finalize

    async def held(self, *args, **kwargs):
        await asyncio.sleep(seconds)
        return await finalize(self, *args, **kwargs)

    atomicity.AtomicRenameTemporaryPath.finalize = held


if __name__ == "__main__":
    if os.environ.get("NORMVIT_TEST_RECORD") or os.environ.get("NORMVIT_TEST_RECORD_EVAL"):
        _record(os.environ.get("NORMVIT_TEST_RECORD"), os.environ.get("NORMVIT_TEST_RECORD_EVAL"))
    if os.environ.get("NORMVIT_TEST_HOLD_COMMIT"):
        _hold_commits(float(os.environ["NORMVIT_TEST_HOLD_COMMIT"]))
    if os.environ.get("NORMVIT_TEST_WORKDIR_WAIT_S"):
        from normvit_jax import distributed
        distributed.check_shared_workdir.__defaults__ = (
            float(os.environ["NORMVIT_TEST_WORKDIR_WAIT_S"]),)
    sys.argv[0] = os.path.join(REPO, "main.py")
    runpy.run_path(sys.argv[0], run_name="__main__")
