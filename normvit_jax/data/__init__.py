"""Input pipelines: tfds sources (CIFAR in memory, ImageNet by random access), the bundled digits
demo set, host-side augmentation, per-host sharding and background prefetch.

    ds = data.resolve_data_spec(config)   # the run's DataSpec: classes, shape, value range, ...
    p = data.make_pipeline(config, 'train' | 'eval', ds, process_index=..., process_count=...)
    p.train_batches(start_step) / p.eval_batches()

Order and resume rules are in ``order``; the digits split in ``digits``.
"""
from normvit_jax.data.errors import DatasetNotFoundError
from normvit_jax.data.pipeline import Pipeline, make_pipeline, train_examples
from normvit_jax.data.dataspec import (NORMALIZE, NUM_CLASSES, DataSpec, check_batch_sizes,
                                       num_classes, resolve_data_spec, validate)
from normvit_jax.data.stats import dataset_stats

__all__ = ["DataSpec", "DatasetNotFoundError", "NORMALIZE", "NUM_CLASSES", "Pipeline",
           "check_batch_sizes", "dataset_stats", "make_pipeline", "num_classes",
           "resolve_data_spec", "train_examples", "validate"]
