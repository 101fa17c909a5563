"""Runs main.py unchanged, with two test-only instruments switched on by environment variables:

NORMVIT_TEST_RECORD=path       appends one line per train batch the loop consumes: its example
                               indices (config.data.return_index), to check the data order.
NORMVIT_TEST_HOLD_COMMIT=secs  every Orbax checkpoint waits that long before its atomic rename,
                               so a test can SIGKILL the run while a checkpoint is half-written.

The faults themselves (signals, truncated files, read-only dirs, ...) come from the test.
"""
import asyncio
import os
import runpy
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _record(path: str) -> None:
    import numpy as np
    from normvit_jax import sharding

    to_global = sharding.to_global

    def recording(batch, mesh):
        if "index" in batch and "mask" not in batch:  # train batches only
            with open(path, "a") as f:
                f.write(" ".join(map(str, np.asarray(batch["index"]).tolist())) + "\n")
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
    if os.environ.get("NORMVIT_TEST_RECORD"):
        _record(os.environ["NORMVIT_TEST_RECORD"])
    if os.environ.get("NORMVIT_TEST_HOLD_COMMIT"):
        _hold_commits(float(os.environ["NORMVIT_TEST_HOLD_COMMIT"]))
    sys.argv[0] = os.path.join(REPO, "main.py")
    runpy.run_path(sys.argv[0], run_name="__main__")
