"""Repeated augmentation (DeiT's RASampler) in the train order: copies per example and epoch,
copies spread over processes, a pure function of the step (exact resume), own augmentations."""
from __future__ import annotations

import collections

import numpy as np
import pytest

from normvit_jax import data
from normvit_jax.data import order
from tests.conftest import tiny_demo_config


def test_repeats_one_is_the_plain_order():
    n, b = 50, 8
    a, r1 = order.TrainOrder(3, n, b), order.TrainOrder(3, n, b, repeats=1)
    stream = np.concatenate([order.permutation(3, e, n) for e in range(3)])
    for s in range(15):
        np.testing.assert_array_equal(r1.indices(s, 0, b), a.indices(s, 0, b))
        np.testing.assert_array_equal(a.indices(s, 0, b), stream[s * b:(s + 1) * b])


@pytest.mark.parametrize("n,b,r", [(36, 12, 3), (50, 8, 3), (40, 8, 2)])
def test_each_epoch_holds_the_first_examples_of_its_permutation_r_times(n, b, r):
    """Reference: DeiT's list [x for x in perm for _ in range(r)][:N] per epoch; the batch rows
    are a permutation of that stream's positions (so an epoch holds the same multiset)."""
    o = order.TrainOrder(7, n, b, repeats=r)
    steps = 3 * n // b
    got = np.concatenate([o.indices(s, 0, b) for s in range(steps)])
    ref = np.concatenate([np.repeat(order.permutation(7, e, n), r)[:n] for e in range(3)])
    for s in range(steps):  # every global batch is the same multiset as the reference stretch
        assert sorted(got[s * b:(s + 1) * b]) == sorted(ref[s * b:(s + 1) * b])
    for e in range(3):
        counts = collections.Counter(ref[e * n:(e + 1) * n].tolist())
        assert len(counts) == -(-n // r)
        assert sorted(counts.values())[1:] == [r] * (len(counts) - 1)  # the last group may be cut


def test_copies_land_on_different_processes_and_host_rows_agree():
    """N, B divisible by r=3 and P=3 processes: the 3 copies of each example are on 3 processes;
    every process reads its rows of the same global batch whatever P is."""
    n, b, r = 48, 12, 3
    o = order.TrainOrder(1, n, b, repeats=r)
    for s in range(8):
        full = o.indices(s, 0, b)
        for p_count in (1, 2, 3, 4, 6):
            parts = [o.indices(s, *order.host_rows(b, i, p_count)) for i in range(p_count)]
            np.testing.assert_array_equal(np.concatenate(parts), full)
        where = collections.defaultdict(set)
        for proc in range(3):
            lo, hi = order.host_rows(b, proc, 3)
            for x in full[lo:hi]:
                where[int(x)].add(proc)
        assert all(len(v) == 3 for v in where.values()), where


def test_order_is_a_pure_function_of_the_step():
    a = order.TrainOrder(5, 37, 6, repeats=3)
    seq = [a.indices(s, 0, 6) for s in range(20)]
    b = order.TrainOrder(5, 37, 6, repeats=3)  # a resumed run: fresh object, starts at step 13
    for s in (13, 19, 14, 0):
        np.testing.assert_array_equal(b.indices(s, 0, 6), seq[s])


def test_copies_get_different_augmentations():
    cfg = tiny_demo_config(batch_size=12)
    cfg.data.repeated_aug = 3
    cfg.data.crop_padding = 2
    cfg.data.flip = True
    cfg.data.return_index = True
    pipe = data.make_pipeline(cfg, "train", process_index=0, process_count=1)
    batch = pipe.train_batch(5)
    idx = batch["index"]
    groups = collections.defaultdict(list)
    for row, i in enumerate(idx):
        groups[int(i)].append(row)
    assert len(groups) == 4 and all(len(rows) == 3 for rows in groups.values())
    differing = sum(not np.array_equal(batch["image"][rows[0]], batch["image"][rows[k]])
                    for rows in groups.values() for k in (1, 2))
    assert differing >= 6  # 8 pairs; two identical draws (flip + offsets) are unlikely
    assert pipe.steps_per_epoch == pipe.num_examples // 12  # the epoch keeps N samples
    cfg.data.repeated_aug = 0
    with pytest.raises(ValueError, match="data.repeated_aug"):
        data.make_pipeline(cfg, "train", process_index=0, process_count=1)
