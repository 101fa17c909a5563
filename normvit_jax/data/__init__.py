"""Input pipelines: tfds sources (CIFAR in memory, ImageNet by random access), the bundled digits
demo set, host-side augmentation, per-host sharding and background prefetch.

    data.num_classes(name); data.validate(config); data.dataset_stats(name)
    p = data.make_pipeline(config, 'train' | 'eval', process_index=..., process_count=...)
    p.train_batches(start_step) / p.eval_batches()

Order and resume rules are in ``order``; the digits split in ``digits``.
"""
from normvit_jax.data.errors import DatasetNotFoundError
from normvit_jax.data.pipeline import Pipeline, make_pipeline
from normvit_jax.data.spec import NORMALIZE, NUM_CLASSES, num_classes, validate
from normvit_jax.data.stats import dataset_stats

__all__ = ["DatasetNotFoundError", "NORMALIZE", "NUM_CLASSES", "Pipeline", "dataset_stats",
           "make_pipeline", "num_classes", "validate"]
