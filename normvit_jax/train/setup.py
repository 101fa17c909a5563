"""What a run builds before its first step, shared by the train loop and the benchmarks: config
checks, the model, the train state (real or abstract) and the jitted steps over the mesh.

No TensorFlow here (tf.data/tfds datasets import it, seconds of import time): benchmarks and
tools import this module alone. tests/test_train.py checks that.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import linen as nn
from jax.sharding import Mesh

from normvit_jax import data, models, preflight, sharding
from normvit_jax.train import aux_losses, batch_aug, ema
from normvit_jax.train import optimizer as optim
from normvit_jax.train import progress as progress_lib
from normvit_jax.train import steps as steps_lib
from normvit_jax.train.state import TrainState

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """A run config resolved once, before anything is built: what the model and data are."""

    model: Any           # the model's spec (``models.spec_of``; float32, no remat, with num_classes)
    data: data.DataSpec  # ``data.resolve_data_spec``


def resolve_config(config: ml_collections.ConfigDict, num_devices: int | None = None) -> RunSpec:
    """Checks every choice by name and every size constraint before anything is compiled and
    resolves the model's spec and the run's DataSpec (``num_devices``: default all devices).

    Raises ValueError naming the key, its value and what is accepted.
    """
    n = num_devices or jax.device_count()
    data_spec = data.resolve_data_spec(config, n)  # also the one check of the batch sizes
    preflight.check_values(config)
    # checks variant, sizes, norm names and override keys
    spec = models.spec_of(config, data_spec.num_classes)
    if config.data.image_size % spec.patch_size:
        raise ValueError(
            f"config.data.image_size={config.data.image_size} is not divisible by the patch size "
            f"{spec.patch_size} (model.patch_size / model.variant); accepted: a multiple of "
            f"{spec.patch_size}")
    optim.validate(config)
    batch_aug.validate(config, data_spec)
    if config.dtype not in DTYPES:
        raise ValueError(f"config.dtype={config.dtype!r} is not accepted; accepted: {list(DTYPES)}")
    if config.get("mesh"):  # raises naming the keys
        sharding.mesh_shape(n, int(config.mesh.data), int(config.mesh.fsdp))
    for key in ("log_every", "eval_every", "checkpoint_every", "keep_checkpoints"):
        if config[key] < 1:
            raise ValueError(f"config.{key}={config[key]} must be >= 1")
    return RunSpec(spec, data_spec)


def validate_config(config: ml_collections.ConfigDict, num_devices: int | None = None) -> Any:
    """``resolve_config(...).model``: for callers that need only the model's spec."""
    return resolve_config(config, num_devices).model


def create_model(config: ml_collections.ConfigDict, num_classes: int, spec: Any = None) -> nn.Module:
    """The run's model in its compute dtype (``config.dtype``, ``config.remat``); ``spec`` as
    ``validate_config`` returns it, else resolved from ``config``."""
    spec = models.spec_of(config if spec is None else spec, num_classes,
                          dtype=DTYPES[config.dtype], remat=config.remat)
    return models.create(spec)


def state_init(model: nn.Module, tx: optax.GradientTransformation,
               image_shape: tuple[int, ...]) -> Callable[[jax.Array], TrainState]:
    """rng -> the initial TrainState (the model traced once on a zero image)."""
    def init(rng: jax.Array) -> TrainState:
        params_rng, state_rng = jax.random.split(rng)
        variables = model.init({"params": params_rng, "dropout": params_rng},
                               jnp.zeros((1,) + tuple(image_shape), jnp.float32), train=False)
        return TrainState.create(variables["params"], variables.get("batch_stats", {}), tx,
                                 jax.random.key_data(state_rng))
    return init


def abstract_train_state(model: nn.Module, tx: optax.GradientTransformation,
                         image_shape: tuple[int, ...], mesh: Mesh,
                         fsdp_min_size: int = sharding.FSDP_MIN_SIZE) -> tuple[TrainState, Any]:
    """(the state's shapes as ShapeDtypeStructs carrying their sharding, the state's shardings):
    nothing is allocated. Shardings by ``sharding.state_shardings``: all replicated unless the
    mesh has an 'fsdp' axis of size > 1 (``config.mesh``)."""
    abstract = jax.eval_shape(state_init(model, tx, image_shape), jax.random.key(0))
    state_sharding = sharding.state_shardings(abstract, mesh, fsdp_min_size)
    shaped = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                          abstract, state_sharding)
    return shaped, state_sharding


def create_train_state(model: nn.Module, tx: optax.GradientTransformation,
                       image_shape: tuple[int, ...], mesh: Mesh, rng: jax.Array,
                       fsdp_min_size: int = sharding.FSDP_MIN_SIZE) -> tuple[TrainState, Any]:
    """(the initial state, initialised directly into its sharding; its shardings)."""
    _, state_sharding = abstract_train_state(model, tx, image_shape, mesh, fsdp_min_size)
    with threefry_kernel():
        state = jax.jit(state_init(model, tx, image_shape), out_shardings=state_sharding)(rng)
    return state, state_sharding


@contextlib.contextmanager
def threefry_kernel() -> Iterator[None]:
    """Programs traced inside draw their random numbers, on GPU, with JAX's CUDA kernel of the
    threefry hash instead of XLA's inlined one (``jax_threefry_gpu_kernel_lowering``): the same
    algorithm and bits, compiled in a fraction of the time. The init program draws once per
    parameter, and XLA:GPU compiles each inlined hash into kernels of its own: a deviceless compile
    of the B/16 init took 46.7 s with it and 5.8 s with the kernel on a 2-core CPU (it was ~48 s
    of each norm's start in the H200 quick run, docs/benchmarks.md). CPU and TPU ignore the flag;
    the train step keeps the default (the flag may cost memory at run time)."""
    name = "jax_threefry_gpu_kernel_lowering"
    before = getattr(jax.config, name, None)
    if before is None:  # a jax without the flag: its default lowering
        yield
        return
    jax.config.update(name, True)
    try:
        yield
    finally:
        jax.config.update(name, before)


def make_train_step(config: ml_collections.ConfigDict, model: nn.Module,
                    tx: optax.GradientTransformation, lr_schedule: optax.Schedule,
                    data_spec: data.DataSpec) -> Callable:
    """The pure train step with the config's label smoothing, accumulation, NaN policy and
    on-device batch augmentation (train/batch_aug.py); uint8 images become model input by
    ``data_spec.affine``."""
    return steps_lib.make_train_step(model, tx, lr_schedule, label_smoothing=config.label_smoothing,
                                     grad_accum_steps=config.grad_accum_steps,
                                     skip_nonfinite=config.skip_nonfinite_steps > 0,
                                     batch_transform=batch_aug.make(config, data_spec),
                                     input_affine=data_spec.affine,
                                     extra_loss=aux_losses.ExtraLoss.from_config(config))


def train_metrics_shapes(train_step: Callable, state: TrainState, batch_size: int,
                         image_shape: tuple[int, ...]) -> Any:
    """The metrics ``train_step`` (``make_train_step``) returns for ``state``: the run's own
    metrics class (models with step-scheduled norms log more), its leaves as ShapeDtypeStructs.
    Traced abstractly; nothing is compiled or run."""
    batch = {"image": jax.ShapeDtypeStruct((batch_size, *image_shape), jnp.float32),
             "label": jax.ShapeDtypeStruct((batch_size,), jnp.int32)}
    return jax.eval_shape(train_step, state, batch)[1]


def jit_train_step(fn: Callable, state_sharding: Any, mesh: Mesh) -> Any:
    """The train step jitted over the mesh: batch split over all devices, state in its shardings
    (``abstract_train_state``) and donated; metrics replicated."""
    rep, bat = sharding.replicated(mesh), sharding.batch_sharding(mesh)
    return jax.jit(fn, in_shardings=(state_sharding, bat), out_shardings=(state_sharding, rep),
                   donate_argnums=0)


def jit_eval_step(model: nn.Module, state_sharding: Any, mesh: Mesh,
                  affine: tuple[Any, Any] | None = None,
                  extra_sums: Callable[[jax.Array, dict], dict] | None = None) -> Any:
    """The eval step jitted over the mesh; metrics come back replicated. ``affine``
    (``DataSpec.affine``) maps uint8 batch images to model input; ``extra_sums``: see
    ``steps.make_eval_step`` (``evaluate`` adds them up)."""
    rep, bat = sharding.replicated(mesh), sharding.batch_sharding(mesh)
    return jax.jit(steps_lib.make_eval_step(model, affine, extra_sums),
                   in_shardings=(state_sharding, bat), out_shardings=rep)


def evaluate(eval_step: Any, state: TrainState, pipeline: Any, mesh: Mesh) -> dict[str, float]:
    """Metrics of ``eval_step`` over the whole eval split (padded rows masked out), and of the
    EMA weights as ``ema_*`` when the state keeps them (config.ema_decay). An eval step with
    ``extra_sums`` also adds those up over the split, into the result under their names
    (arrays stay numpy arrays)."""
    def one(st: TrainState, label: str) -> dict[str, float]:
        acc, extra = None, {}
        n = getattr(pipeline, "num_examples", 0)  # 0 (a stand-in without it): no progress lines
        progress = progress_lib.EvalProgress(n, getattr(pipeline, "global_batch_size", 1), label)
        for i, batch in enumerate(pipeline.eval_batches()):
            out = eval_step(st, sharding.to_global(batch, mesh))
            m, sums = out if isinstance(out, tuple) else (out, {})
            acc = m if acc is None else acc.merge(m)
            for k, v in sums.items():  # summed on the device; read once at the end
                extra[k] = extra[k] + v if k in extra else v
            progress(i + 1, acc)
        out = {k: float(v) for k, v in acc.compute().items()}
        out["num_examples"] = int(acc.loss.count)
        # a count is a float as the metrics are; an array (per_class.sums) stays one
        return {**out, **{k: float(v) if v.ndim == 0 else np.asarray(v) for k, v in extra.items()}}

    metrics = one(state, "eval")
    averaged = ema.averaged(state)  # EMA weights, and EMA norm statistics when kept
    if averaged is not None:
        metrics.update({f"ema_{k}": v for k, v in one(averaged, "eval (EMA weights)").items()})
    return metrics
