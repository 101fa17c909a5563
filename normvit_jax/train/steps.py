"""Pure train and eval steps; the loop jits them over the mesh.

Backward-updated norm statistics (PowerNorm, UN) follow the one rule of
``normvit_jax.norms.gradient_rule.train_grads``, which the train step calls.
"""

import inspect
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from clu import metrics as clu_metrics
import flax.struct

from normvit_jax.data import stats
from normvit_jax.train import aux_losses, batch_aug, global_norm
from normvit_jax.norms import gradient_rule
from normvit_jax.train.state import TrainState


@flax.struct.dataclass
class TrainMetrics(clu_metrics.Collection):
    loss: clu_metrics.Average.from_output("loss")
    accuracy: clu_metrics.Average.from_output("accuracy")
    grad_norm: clu_metrics.Average.from_output("grad_norm")
    learning_rate: clu_metrics.LastValue.from_output("learning_rate")
    skipped_nonfinite: clu_metrics.Average.from_output("skipped")


@flax.struct.dataclass
class ScheduledTrainMetrics(clu_metrics.Collection):
    """TrainMetrics of a model with step-scheduled norms (norms/progressive.py), plus N1's weight
    at the step (the mean over the norms that sow one in the ``schedule`` collection). clu reads
    a collection's own annotations only, so the fields are repeated."""
    loss: clu_metrics.Average.from_output("loss")
    accuracy: clu_metrics.Average.from_output("accuracy")
    grad_norm: clu_metrics.Average.from_output("grad_norm")
    learning_rate: clu_metrics.LastValue.from_output("learning_rate")
    skipped_nonfinite: clu_metrics.Average.from_output("skipped")
    norm_n1_weight: clu_metrics.LastValue.from_output("norm_n1_weight")


def step_kwargs(model: nn.Module, step: jax.Array) -> dict:
    """``{'step': step}`` for models whose ``__call__`` takes the global train step (ViT: the norms
    scheduled by it read it there), else nothing."""
    return {"step": step} if "step" in inspect.signature(model.__call__).parameters else {}


@flax.struct.dataclass
class EvalMetrics(clu_metrics.Collection):
    loss: clu_metrics.Average.from_output("loss")
    top1: clu_metrics.Average.from_output("top1")
    top5: clu_metrics.Average.from_output("top5")


def cross_entropy(logits: jax.Array, labels: jax.Array, smoothing: float = 0.0) -> jax.Array:
    """Per-example softmax cross-entropy in float32 with label smoothing. ``labels``: int class
    ids (B,) or soft targets (B, classes) (Mixup/CutMix), smoothed the same way."""
    n = logits.shape[-1]
    soft = labels.ndim == logits.ndim
    onehot = labels.astype(jnp.float32) if soft else jax.nn.one_hot(labels, n, dtype=jnp.float32)
    if smoothing:
        onehot = onehot * (1.0 - smoothing) + smoothing / n
    return optax.softmax_cross_entropy(logits.astype(jnp.float32), onehot)


def hard_labels(labels: jax.Array) -> jax.Array:
    """Class ids; for soft targets the class of largest weight (train accuracy under Mixup)."""
    return jnp.argmax(labels, -1) if labels.ndim == 2 else labels


def _tree_where(pred: jax.Array, a: Any, b: Any) -> Any:
    return jax.tree.map(lambda x, y: jnp.where(pred, x, y), a, b)


def make_train_step(model: nn.Module, tx: optax.GradientTransformation, lr_schedule: optax.Schedule,
                    *, label_smoothing: float = 0.0, grad_accum_steps: int = 1,
                    skip_nonfinite: bool = False,
                    batch_transform: batch_aug.BatchTransform | None = None,
                    input_affine: tuple[Any, Any] | None = None,
                    extra_loss: aux_losses.ExtraLoss | None = None) -> Callable:
    """Returns ``train_step(state, batch) -> (state, metrics)``.

    With ``grad_accum_steps > 1`` the batch is split into that many micro-batches whose gradients
    are averaged (sequentially, so memory is that of one micro-batch); norm state flows through
    the micro-batches in order. ``batch_transform`` (``batch_aug.make``): on-device augmentation
    of the whole batch (random erasing, Mixup/CutMix) before any split; None: none.
    ``input_affine``: maps uint8 batch images to model input (``data.stats.model_input``).
    ``extra_loss`` (``aux_losses.ExtraLoss.from_config``): LearnableScaler's feature decay and
    attention loss, added to the mean cross-entropy (and to the logged loss); None: none.
    """
    collections = ["batch_stats", "schedule"] + (extra_loss.collections if extra_loss else [])

    def apply(v, images, rng, step):
        # The global train step reaches step-scheduled norms; what they sow under 'schedule'
        # (N1's weight) comes back beside the logits for the metrics.
        out, mutated = model.apply(v, images, train=True, rngs={"dropout": rng},
                                   mutable=collections, **step_kwargs(model, step))
        if extra_loss is None:
            return (out, mutated.get("schedule", {})), mutated
        return (out, mutated.get("schedule", {}), extra_loss(mutated)), mutated

    def objective(out, labels):
        ce = jnp.mean(cross_entropy(out[0], labels, label_smoothing))
        return ce if extra_loss is None else ce + out[2]

    def loss_and_grads(params, batch_stats, images, labels, rng, step):
        loss, g_params, new_bs, (logits, sched, *_) = gradient_rule.train_grads(
            lambda v: apply(v, images, rng, step), params, batch_stats,
            lambda out: objective(out, labels))
        correct = jnp.mean((jnp.argmax(logits, -1) == hard_labels(labels)).astype(jnp.float32))
        return loss, correct, g_params, new_bs, sched

    def train_step(state: TrainState, batch: dict) -> tuple[TrainState, TrainMetrics]:
        rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
        images, labels = stats.model_input(batch["image"], input_affine), batch["label"]
        if batch_transform is not None:  # labels may become soft targets (B, classes)
            images, labels = batch_transform(rng, images, labels)
        if grad_accum_steps == 1:
            loss, acc, grads, new_bs, sched = loss_and_grads(state.params, state.batch_stats,
                                                             images, labels, rng, state.step)
        else:
            loss, acc, grads, new_bs, sched = _accumulate(loss_and_grads, state, images, labels,
                                                          rng, grad_accum_steps)
        new_state, grad_norm, finite = _update(state, tx, grads, new_bs, loss, skip_nonfinite)
        return new_state, _metrics(sched, loss=loss, accuracy=acc, grad_norm=grad_norm,
                                   learning_rate=lr_schedule(_schedule_count(state)),
                                   skipped=(~finite).astype(jnp.float32))

    return train_step


def _accumulate(loss_and_grads: Callable, state: TrainState, images: jax.Array, labels: jax.Array,
                rng: jax.Array, k: int) -> tuple:
    """``loss_and_grads`` over k micro-batches in sequence (memory of one): gradients, loss and
    accuracy averaged; the norm state flows through them in order."""
    split = lambda x: x.reshape((k, x.shape[0] // k) + x.shape[1:])  # noqa: E731

    def micro(carry, xs):
        g_sum, bs, loss_sum, acc_sum = carry
        i, im, lb = xs
        loss, acc, g, bs, sched = loss_and_grads(state.params, bs, im, lb,
                                                 jax.random.fold_in(rng, i), state.step)
        return (jax.tree.map(jnp.add, g_sum, g), bs, loss_sum + loss, acc_sum + acc), sched

    zeros = jax.tree.map(jnp.zeros_like, state.params)
    (g_sum, new_bs, loss_sum, acc_sum), sched = jax.lax.scan(
        micro, (zeros, state.batch_stats, 0.0, 0.0), (jnp.arange(k), split(images), split(labels)))
    return loss_sum / k, acc_sum / k, jax.tree.map(lambda g: g / k, g_sum), new_bs, sched


def _update(state: TrainState, tx: optax.GradientTransformation, grads: Any, new_bs: Any,
            loss: jax.Array, skip_nonfinite: bool) -> tuple[TrainState, jax.Array, jax.Array]:
    """(the state after the optimizer step, the gradient norm, whether loss and norm are
    finite); with ``skip_nonfinite`` a non-finite step keeps the weights, optimizer and norm
    state and only counts itself."""
    grad_norm = global_norm.global_norm(grads)  # the clip's own: XLA computes it once
    # batch_stats: for the EMA of the norm statistics (train/ema.py); other parts ignore it
    updates, opt_state = optax.with_extra_args_support(tx).update(
        grads, state.opt_state, state.params, batch_stats=new_bs)
    params = optax.apply_updates(state.params, updates)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state,
                              batch_stats=new_bs,
                              nonfinite_streak=jnp.where(finite, 0, state.nonfinite_streak + 1))
    if skip_nonfinite:
        kept = state.replace(step=state.step + 1, nonfinite_streak=new_state.nonfinite_streak)
        new_state = _tree_where(finite, new_state, kept)
    return new_state, grad_norm, finite


def _schedule_count(state: TrainState) -> jax.Array:
    """The schedule position the optimizer's update used: optax's own count, which a skipped
    non-finite step does not advance (so it lags ``state.step`` after one); ``state.step`` where
    the optimizer keeps no count."""
    is_count = lambda x: isinstance(x, optax.ScaleByScheduleState)  # noqa: E731
    counts = [s.count for s in jax.tree.leaves(state.opt_state, is_leaf=is_count) if is_count(s)]
    return counts[0] if counts else state.step


def _metrics(sched: Any, **outputs: jax.Array) -> Any:
    """The step's metrics; with step-scheduled norms (what they sowed in ``sched``) also N1's
    weight, the same for every micro-batch, so any micro-batch's values will do."""
    weights = jax.tree.leaves(sched)
    if weights:
        outputs["norm_n1_weight"] = jnp.mean(jnp.stack([jnp.mean(w) for w in weights]))
        return ScheduledTrainMetrics.single_from_model_output(**outputs)
    return TrainMetrics.single_from_model_output(**outputs)


def argmax_order(logits: jax.Array) -> jax.Array:
    """``logits`` ranked by ``jax.lax.top_k`` as ``jnp.argmax`` (top-1) ranks them: every NaN
    first (+NaN; top_k's total order puts a NaN with its sign bit, x86's inf - inf, last) and
    -0.0 tied with +0.0 (top_k: below), so a top-1 hit is a top-5 hit. NaN first is also
    torch.topk's rule (timm's accuracy)."""
    return jnp.where(jnp.isnan(logits), jnp.nan, jnp.where(logits == 0, 0.0, logits))


def make_eval_step(model: nn.Module, input_affine: tuple[Any, Any] | None = None,
                   extra_sums: Callable[[jax.Array, dict], dict] | None = None) -> Callable:
    """Returns ``eval_step(state, batch) -> EvalMetrics`` over the rows with mask 1 (uint8 images
    are mapped by ``input_affine``, as in the train step). With ``extra_sums(logits, batch) ->
    {name: per-batch sum}`` (e.g. ImageNet-ReaL's counts) it returns ``(EvalMetrics, sums)``
    from the same forward pass."""

    def eval_step(state: TrainState, batch: dict) -> Any:
        logits = model.apply(state.variables(), stats.model_input(batch["image"], input_affine),
                             train=False, **step_kwargs(model, state.step))
        labels = batch["label"]
        loss = cross_entropy(logits, labels)
        top1 = (jnp.argmax(logits, -1) == labels).astype(jnp.float32)
        k = min(5, logits.shape[-1])  # timm: min(k, classes)
        topk = jax.lax.top_k(argmax_order(logits), k)[1]
        top5 = jnp.any(topk == labels[:, None], axis=-1).astype(jnp.float32)
        mask = batch["mask"].astype(bool)
        metrics = EvalMetrics.single_from_model_output(loss=loss, top1=top1, top5=top5, mask=mask)
        if extra_sums is None:
            return metrics
        return metrics, extra_sums(logits.astype(jnp.float32), batch)

    return eval_step
