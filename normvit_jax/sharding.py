"""The device mesh and shardings; nothing else in the project knows about devices.

One mesh over all devices of all hosts with axes ('data', 'fsdp') (``config.mesh``): the batch is
sharded over both axes together; each large array of the train state (parameters, optimizer
moments, EMA weights) is split over 'fsdp' along its largest divisible axis, the rest replicated
(``state_shardings``). With fsdp=1 (the default) every array is replicated: plain data
parallelism. Under ``jax.jit`` a mean over the batch axis is global (synchronised batch
statistics) and XLA gathers the sharded weights where a layer needs them (ZeRO-3 style), without
any collective written by hand.
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

DATA_AXIS = "data"
FSDP_AXIS = "fsdp"
BATCH_AXES = (DATA_AXIS, FSDP_AXIS)  # the batch is split over every device
FSDP_MIN_SIZE = 2 ** 14  # arrays with fewer elements stay replicated (biases, norm scales)


def mesh_shape(num_devices: int, data: int = -1, fsdp: int = 1) -> tuple[int, int]:
    """(data, fsdp) sizes for ``num_devices``; -1 for one of them: the rest. Raises ValueError
    naming ``config.mesh`` keys when they do not multiply to the device count."""
    if fsdp == -1 and data == -1:
        raise ValueError("config.mesh.data and config.mesh.fsdp are both -1; accepted: at most one")
    for key, v in (("data", data), ("fsdp", fsdp)):
        if v != -1 and v < 1:
            raise ValueError(f"config.mesh.{key}={v} is not accepted; accepted: -1 (the rest) or >= 1")
    given = (data, fsdp)  # for the message: -1 is what the user set, not a resolved 0
    if data == -1:
        data = num_devices // fsdp if num_devices % fsdp == 0 else 0
    elif fsdp == -1:
        fsdp = num_devices // data if num_devices % data == 0 else 0
    if data * fsdp != num_devices or data < 1 or fsdp < 1:
        divisors = [d for d in range(1, num_devices + 1) if num_devices % d == 0]
        raise ValueError(f"config.mesh.data x config.mesh.fsdp must equal the number of devices "
                         f"({num_devices}); got data={given[0]}, fsdp={given[1]}; accepted: "
                         f"divisors of {num_devices} {divisors} whose product is {num_devices} "
                         "(-1 for one of them: the rest)")
    return data, fsdp


def make_mesh(config: Any = None, *, devices: list[Any] | None = None) -> Mesh:
    """The ('data', 'fsdp') mesh of ``config.mesh`` (no config: data=-1, fsdp=1)
    over ``devices`` (all devices of all processes by default).

    'fsdp' is the inner axis: its groups are consecutive devices (``jax.devices()`` lists them
    process by process), so with fsdp dividing the devices per host the weights are gathered
    within a host and only the gradient reduction over 'data' crosses hosts."""
    devices = jax.devices() if devices is None else list(devices)
    data, fsdp = (-1, 1) if config is None else (int(config.mesh.data), int(config.mesh.fsdp))
    data, fsdp = mesh_shape(len(devices), data, fsdp)
    return Mesh(np.asarray(devices).reshape(data, fsdp), (DATA_AXIS, FSDP_AXIS))


def fsdp_min_size(config: Any = None) -> int:
    """``config.mesh.fsdp_min_size`` (no config: ``FSDP_MIN_SIZE``, configs/default.py's value)."""
    return FSDP_MIN_SIZE if config is None else int(config.mesh.fsdp_min_size)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) axis split over all mesh axes ('data' and 'fsdp'), the rest replicated."""
    return NamedSharding(mesh, P(tuple(a for a in BATCH_AXES if a in mesh.axis_names)))


def fsdp_spec(shape: tuple[int, ...], fsdp: int, min_size: int = FSDP_MIN_SIZE) -> P:
    """The rule for one array of the train state: its largest axis divisible by ``fsdp`` (the
    last such on ties) split over 'fsdp', if it has at least ``min_size`` elements; else P()
    (replicated). Shape-only, so optimizer moments and EMA weights follow their parameters."""
    if fsdp <= 1 or int(np.prod(shape, dtype=np.int64)) < max(min_size, 1):
        return P()
    axes = [i for i, n in enumerate(shape) if n % fsdp == 0]
    if not axes:
        return P()
    best = max(axes, key=lambda i: (shape[i], i))
    return P(*([None] * best + [FSDP_AXIS]))


def describe_fsdp(params: Any, fsdp: int, min_size: int = FSDP_MIN_SIZE) -> str | None:
    """How many parameter arrays (and bytes) ``fsdp_spec`` splits over ``fsdp`` devices, for the
    start-up line (optimizer moments and EMA weights follow their parameters); None for fsdp=1."""
    if fsdp <= 1:
        return None
    leaves = jax.tree.leaves(params)
    big = [x for x in leaves if int(np.prod(x.shape, dtype=np.int64)) >= max(min_size, 1)]
    split = [x for x in leaves if fsdp_spec(tuple(x.shape), fsdp, min_size) != P()]
    head = f"fsdp={fsdp} splits {len(split)} of {len(leaves)} parameter arrays"
    if not big:
        return f"{head} (none has >= fsdp_min_size={min_size} elements)"
    if not split:
        return (f"{head} (none of the {len(big)} with >= fsdp_min_size={min_size} elements has an "
                f"axis divisible by {fsdp})")
    nbytes = lambda xs: sum(int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
                            for x in xs)
    return (f"{head} ({nbytes(split):,} of {nbytes(leaves):,} bytes; those with >= "
            f"fsdp_min_size={min_size} elements and an axis divisible by {fsdp})")


def state_shardings(abstract: Any, mesh: Mesh, min_size: int = FSDP_MIN_SIZE) -> Any:
    """A NamedSharding per leaf of ``abstract`` (shapes, e.g. from ``jax.eval_shape``) by
    ``fsdp_spec``."""
    fsdp = int(mesh.shape.get(FSDP_AXIS, 1))
    return jax.tree.map(lambda x: NamedSharding(mesh, fsdp_spec(tuple(x.shape), fsdp, min_size)),
                        abstract)


def to_global(batch: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    """Host-local batch rows -> global ``jax.Array``s sharded on the batch axis.

    Each process passes only its own rows; the global batch is their concatenation in process order.
    """
    sharding = batch_sharding(mesh)
    return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v))
            for k, v in batch.items()}


def maybe_initialize_distributed() -> None:
    """Joins JAX's distributed runtime when this process is one of several (srun step, TPU pod,
    JAX_COORDINATOR_ADDRESS), with a bounded wait: normvit_jax/distributed.py; then only process 0
    logs the metric lines."""
    from normvit_jax import distributed, logs
    if distributed.initialize() is not None:
        logs.only_process_zero_informs(jax.process_index())

