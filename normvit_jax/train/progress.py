"""The ETA of the progress line: steps per second of training alone.

The first interval (start to the first log step) holds the compilation where the step was not
measured first (accelerators, short runs: the progress line then says "compilation included"),
and evals and checkpoint writes stop the steps for a while; counting either made the ETA far too
long at first and jump after each eval. ``Eta`` measures from the first log step on, with paused sections left out, and
averages over the whole run so far (not the last interval), so the estimate settles.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any, Callable, Iterator

# Runs with at least this many steps left time the step before the first one (on a copy of the
# state: 1 + MEASURE_STEPS extra steps, at most 5% of the run) and print the expected run time.
MEASURE_MIN_STEPS = 100
MEASURE_STEPS = 4


class Eta:
    """``mark(step)`` at each log step (after the step's results are on the host), ``paused()``
    around evals and checkpoint writes, ``remaining_s(step)`` for the estimate."""

    def __init__(self, total_steps: int, clock: Callable[[], float] = time.monotonic):
        self.total_steps = total_steps
        self._clock = clock
        self._base_step: int | None = None   # the first mark: everything before is compilation
        self._base_time = 0.0
        self._paused_s = 0.0                  # paused time since the first mark
        self._last: tuple[int, float, float] | None = None  # step, time, paused_s then
        self._prev: tuple[int, float, float] | None = None  # the mark before _last

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Time spent in here is not training time (an eval, a checkpoint write)."""
        t = self._clock()
        try:
            yield
        finally:
            if self._base_step is not None:
                self._paused_s += self._clock() - t

    def mark(self, step: int) -> None:
        now = self._clock()
        if self._base_step is None:
            self._base_step, self._base_time = step, now
            self._last = (step, now, 0.0)
        else:
            self._prev, self._last = self._last, (step, now, self._paused_s)

    def steps_per_s(self) -> float | None:
        """Training steps per second since the first mark, pauses left out; None before two marks."""
        if self._prev is None:
            return None
        step, now, paused_s = self._last
        train_s = now - self._base_time - paused_s
        return (step - self._base_step) / train_s if train_s > 0 and step > self._base_step else None

    def interval_steps_per_s(self) -> float | None:
        """Steps per second between the last two marks, pauses left out; None before two marks."""
        if self._prev is None:
            return None
        (s0, t0, p0), (s1, t1, p1) = self._prev, self._last
        train_s = t1 - t0 - (p1 - p0)
        return (s1 - s0) / train_s if train_s > 0 else None

    def remaining_s(self, step: int) -> float | None:
        rate = self.steps_per_s()
        return None if rate is None else max(self.total_steps - step, 0) / rate

    def describe(self, step: int) -> str:
        """'1m05s', or what is known before a rate exists."""
        if step >= self.total_steps:
            return "0m00s"
        left = self.remaining_s(step)
        return "estimating" if left is None else fmt_time(left)


def measure_step_s(train_step: Callable, state: Any, batch: Any,
                   steps: int = MEASURE_STEPS) -> tuple[float, float]:
    """(median seconds of ``steps`` train steps, seconds of the first call, which compiles the
    step the run then reuses), stepping a throwaway copy of ``state`` (the step donates its
    state) on ``batch``; the run's own state is untouched."""
    import jax
    trial = jax.tree.map(lambda x: x.copy(), state)
    times = []
    for _ in range(steps + 1):
        t = time.perf_counter()
        trial, metrics = train_step(trial, batch)
        jax.block_until_ready((trial, metrics))
        times.append(time.perf_counter() - t)
    del trial
    return statistics.median(times[1:]), times[0]


def expected_time_line(start_step: int, total_steps: int, step_s: float) -> str:
    """'Expected run time: 900 steps x 0.412 s = 6m11s ...' (the steps left when resuming)."""
    left = total_steps - start_step
    what = f"{left} steps" if start_step == 0 else f"{left} steps left of {total_steps}"
    return (f"Expected run time: {what} x {step_s:.3g} s = {fmt_time(left * step_s)} of training "
            f"(the median of {MEASURE_STEPS} steps measured now; evaluations and checkpoints come "
            "on top).")


def describe_steps(n_steps: int, num_examples: int, batch_size: int) -> str:
    """'880 steps (22 per epoch)'; where an epoch is not a whole number of steps, its fraction and
    the epochs the steps cover: '100 steps (2.8 per epoch, 35.5 epochs)'. The data order is one
    stream of epochs (data/order.py), so the resume line's 'epoch 7, example 10 of 361' counts
    those, and a bare '2 per epoch' (the rounded-down count) contradicted it."""
    per_epoch = num_examples / batch_size
    if per_epoch == int(per_epoch):
        return f"{n_steps} steps ({int(per_epoch)} per epoch)"
    return f"{n_steps} steps ({per_epoch:.1f} per epoch, {n_steps / per_epoch:.1f} epochs)"


def fmt_time(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def describe_model(spec: Any) -> str:
    """The sizes the model is built with, e.g. 'ViT-B/16 (depth 12, width 768, 12 heads, MLP 3072,
    patch 16)'; the variant's name only where no size was overridden."""
    from normvit_jax import models
    keys = ("depth", "hidden_size", "num_heads", "mlp_dim", "patch_size")
    sizes = (f"depth {spec.depth}, width {spec.hidden_size}, {spec.num_heads} heads, "
             f"MLP {spec.mlp_dim}, patch {spec.patch_size}")
    title = spec.title  # 'ViT', 'T2T-ViT'
    if not spec.variant:
        return f"{title} ({sizes})"
    preset = models.spec_of({"name": spec.family, "variant": spec.variant})
    changed = [k for k in keys if getattr(preset, k) != getattr(spec, k)]
    if not changed:
        return f"{spec.variant_title()} ({sizes})"
    return f"{title} ({sizes}; model.variant {spec.variant} with {', '.join(changed)} overridden)"
