"""The device mesh and shardings; nothing else in the project knows about devices.

One mesh over all devices of all hosts with a 'data' axis: the batch is sharded on it, parameters
and optimizer state are replicated. Under ``jax.jit`` a mean over the batch axis is then global
(synchronised batch statistics) without any collective written by hand.
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

DATA_AXIS = "data"


def make_mesh(devices: list[Any] | None = None) -> Mesh:
    """A 1-D 'data' mesh over ``devices`` (all devices of all processes by default)."""
    devices = jax.devices() if devices is None else devices
    return Mesh(np.asarray(devices), (DATA_AXIS,))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) axis split over 'data', the rest replicated."""
    return NamedSharding(mesh, P(DATA_AXIS))


def to_global(batch: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    """Host-local batch rows -> global ``jax.Array``s sharded on the batch axis.

    Each process passes only its own rows; the global batch is their concatenation in process order.
    """
    sharding = batch_sharding(mesh)
    return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v))
            for k, v in batch.items()}


def maybe_initialize_distributed() -> None:
    """Joins JAX's distributed runtime when this process is one of several (srun step, TPU pod,
    JAX_COORDINATOR_ADDRESS), with a bounded wait: normvit_jax/distributed.py."""
    from normvit_jax import distributed
    distributed.initialize()


def sync_hosts(name: str) -> None:
    """A barrier over all processes (no-op for one): e.g. after process 0 prepared the workdir."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)
