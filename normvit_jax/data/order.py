"""Which examples (and which random draws) make up each batch: pure functions, no state.

Train order: a global example stream, the concatenation of one permutation of the split per epoch,
``perm(seed, 0) ++ perm(seed, 1) ++ ...``; global batch ``s`` is stream positions
``[s*B, (s+1)*B)``. Every example appears exactly once in each epoch's stretch of N positions and
nothing is dropped; a batch may straddle two epochs. Any batch is computed directly from its step
(one permutation per epoch touched), so resuming at step s costs the same as any other step.

Host sharding: process i of P owns rows ``[i*B/P, (i+1)*B/P)`` of every global batch and reads
only those examples. Augmentation draws are generated for the whole global batch from (seed, step)
and sliced the same way, so the draws of an example depend on (seed, step, row), never on P.

Repeated augmentation (DeiT's RASampler, ``repeats`` r > 1): epoch e's N positions hold
``perm(seed, e)[q // r]``, i.e. the first ceil(N/r) examples of the permutation, each r times in a
row (an epoch keeps N samples and its step count, as in DeiT). Within a global batch, rows take
the batch's stream positions sorted by (position mod r, position), so the r copies of an example
sit about B/r rows apart: on r different processes when there are at least r of them, whatever P
is. Each copy has its own row, hence its own augmentation draws. r = 1 is the plain order.

Eval: no shuffle; global batch b covers positions ``[b*B, (b+1)*B)``, positions >= N are padding.
"""
from __future__ import annotations

import math
import threading

import numpy as np

from normvit_jax.data import transforms

_ORDER, _AUG = 0x0D0E, 0xA06  # separate streams for order and augmentation


def _seed(seed: int) -> int:
    return int(seed) % (1 << 63)  # SeedSequence wants non-negative entropy


def permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    """The order of epoch ``epoch``: a permutation of range(n), a pure function of its arguments."""
    return np.random.default_rng([_ORDER, _seed(seed), int(epoch)]).permutation(n)


_FIRST_COLUMNS = transforms.U_INTERP  # the per-example draws of the first release (25)


def aug_uniforms(seed: int, step: int, global_batch: int, num: int) -> np.ndarray:
    """(global_batch, num) float64 uniforms in [0, 1) for the rows of global batch ``step``.
    Columns past the first 25 are drawn after all of those, so a column added for a new
    transform leaves every earlier draw (and every earlier run's batches) as it was."""
    rng = np.random.default_rng([_AUG, _seed(seed), int(step)])
    first = rng.random((global_batch, min(num, _FIRST_COLUMNS)))
    if num <= _FIRST_COLUMNS:
        return first
    return np.concatenate([first, rng.random((global_batch, num - _FIRST_COLUMNS))], axis=1)


def host_rows(global_batch: int, process_index: int, process_count: int) -> tuple[int, int]:
    """[lo, hi) rows of each global batch that this process owns."""
    if global_batch % process_count:
        raise ValueError(f"global batch size {global_batch} is not divisible by the number of "
                         f"processes {process_count}")
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index} not in [0, {process_count})")
    local = global_batch // process_count
    return process_index * local, (process_index + 1) * local


def num_eval_batches(n: int, global_batch: int) -> int:
    return math.ceil(n / global_batch)


class TrainOrder:
    """Maps (step, rows) to example indices, caching the few most recent epoch permutations."""

    def __init__(self, seed: int, n: int, global_batch: int, repeats: int = 1):
        if n < 1:
            raise ValueError("the training split is empty")
        if repeats < 1:
            raise ValueError(f"repeats={repeats} must be >= 1")
        self.seed, self.n, self.global_batch, self.repeats = seed, n, global_batch, int(repeats)
        o = np.arange(global_batch, dtype=np.int64)
        # row -> stream offset in the batch: copy c of every group first for c = 0, 1, ...
        self._row_offset = np.argsort((o % repeats) * global_batch + o, kind="stable")
        self._cache: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()  # several iterators may share one pipeline

    def _perm(self, epoch: int) -> np.ndarray:
        with self._lock:
            p = self._cache.get(epoch)
            if p is None:
                p = permutation(self.seed, epoch, self.n)
                if len(self._cache) >= 4:
                    self._cache.pop(min(self._cache))
                self._cache[epoch] = p
            return p

    def indices(self, step: int, lo: int, hi: int) -> np.ndarray:
        """Example indices of rows [lo, hi) of global batch ``step``."""
        if self.repeats == 1:
            pos = step * self.global_batch + np.arange(lo, hi, dtype=np.int64)
        else:
            pos = step * self.global_batch + self._row_offset[lo:hi]
        epoch, offset = np.divmod(pos, self.n)
        offset //= self.repeats  # the group of r consecutive positions shares one example
        out = np.empty(len(pos), np.int64)
        for e in np.unique(epoch):
            m = epoch == e
            out[m] = self._perm(int(e))[offset[m]]
        return out
