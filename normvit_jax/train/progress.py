"""The ETA of the progress line: a wall-clock estimate of the time left.

The first interval (start to the first log step) holds the compilation where the step was not
measured first (accelerators, short runs: the progress line then says "compilation included"),
and evals and checkpoint writes stop the steps for a while. ``Eta`` measures the training rate from
the first log step on with those pauses left out (the steps/s of the progress line: training
throughput), averaged over the whole run so far so the estimate settles, and adds what the pauses
still to come will take: the evals and checkpoint writes left times the mean measured duration of
each, the first one (which compiles) left out. Until a second eval or write is measured the
estimate says so ("+ evals", "+ checkpoints"): leaving them out made a run with frequent evals
end 60% later than its ETA said, and the first one alone, compilation included, times the evals
left made the demo's ETA jump (0m26s -> 1m02s -> 0m14s).
"""
from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any, Callable, Iterator

from normvit_jax.data import order

# Runs with at least this many steps left time the step before the first one (on a copy of the
# state: 1 + MEASURE_STEPS extra steps, at most 5% of the run) and print the expected run time.
MEASURE_MIN_STEPS = 100
MEASURE_STEPS = 4

# the kinds of pauses that are predicted, with the words of the progress line and the final line
KINDS = {"eval": ("evals", "evaluations"), "save": ("checkpoints", "checkpoint writes")}


def events_left(step: int, total_steps: int, every: int | None) -> int:
    """How many of the steps ``step``..``total_steps`` do an event of period ``every`` (the loop
    evaluates and saves every ``every`` steps and at the last step; a log line comes before the
    eval and save of its own step, so ``step`` itself counts)."""
    if not every or step > total_steps:
        return 0
    step = max(step, 1)  # step 0 does no event: its period's first is step ``every``
    return total_steps // every - (step - 1) // every + (total_steps % every != 0)


class Eta:
    """``mark(step)`` at each log step (after the step's results are on the host),
    ``paused(kind)`` around evals (``"eval"``), checkpoint writes (``"save"``) and other waits
    (``None``: not predicted, e.g. a next phase's compile), ``remaining_s(step)`` for the estimate.
    ``eval_every``/``checkpoint_every``: the loop's periods (it also evaluates and saves at the last
    step); None: those pauses are not predicted."""

    def __init__(self, total_steps: int, clock: Callable[[], float] = time.monotonic,
                 eval_every: int | None = None, checkpoint_every: int | None = None):
        self.total_steps = total_steps
        self._clock = clock
        self._every = {"eval": eval_every, "save": checkpoint_every}
        self._start = clock()
        self._durations: dict[str, list[float]] = {k: [] for k in KINDS}
        self._base_step: int | None = None   # the first mark: everything before is compilation
        self._base_time = 0.0
        self._paused_s = 0.0                  # paused time since the first mark
        self._last: tuple[int, float, float] | None = None  # step, time, paused_s then
        self._prev: tuple[int, float, float] | None = None  # the mark before _last

    @contextlib.contextmanager
    def paused(self, kind: str | None = None) -> Iterator[None]:
        """Time spent in here is not training time (an eval, a checkpoint write)."""
        t = self._clock()
        try:
            yield
        finally:
            dt = self._clock() - t
            if kind is not None:
                self._durations[kind].append(dt)
            if self._base_step is not None:
                self._paused_s += dt

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
        """Steps per second between the last two marks, pauses left out (training throughput);
        None before two marks."""
        if self._prev is None:
            return None
        (s0, t0, p0), (s1, t1, p1) = self._prev, self._last
        train_s = t1 - t0 - (p1 - p0)
        return (s1 - s0) / train_s if train_s > 0 else None

    def mean_s(self, kind: str) -> float | None:
        """The mean duration of the ``kind`` pauses measured, the first (which compiles) left out;
        None before a second one is measured."""
        d = self._durations[kind]
        if len(d) < 2:
            return None
        return statistics.fmean(d[1:])

    def _pauses_left(self, step: int) -> tuple[float, list[str]]:
        """(seconds of the evals and writes left that have a measured duration, the words of those
        that have none yet)."""
        seconds, unknown = 0.0, []
        for kind, (word, _) in KINDS.items():
            n = events_left(step, self.total_steps, self._every[kind])
            if n:
                mean = self.mean_s(kind)
                if mean is None:
                    unknown.append(word)
                else:
                    seconds += n * mean
        return seconds, unknown

    def remaining_s(self, step: int) -> float | None:
        """Wall-clock seconds left: the train steps left at the training rate, plus the evals and
        checkpoint writes left at their measured means (those not measured yet left out:
        ``describe`` names them); None before a rate exists."""
        rate = self.steps_per_s()
        if rate is None:
            return None
        return max(self.total_steps - step, 0) / rate + self._pauses_left(step)[0]

    def describe(self, step: int) -> str:
        """'1m05s', '1m05s + evals' (fewer than two measured yet), or what is known before a rate
        exists."""
        known, unknown = self._pauses_left(step)
        if step >= self.total_steps:  # the last step's eval and write may be still to come
            left = known
        else:
            left = self.remaining_s(step)
            if left is None:
                return "estimating"
        return fmt_time(left) + (f" + {' and '.join(unknown)}" if unknown else "")

    def wall_time_line(self) -> str:
        """'Wall time 5m10s: training 4m02s (compilation included), evaluations 0m58s (30),
        checkpoint writes 0m10s (3).' since this object was made (the start of the loop)."""
        total = self._clock() - self._start
        parts = []
        paused = 0.0
        for kind, (_, words) in KINDS.items():
            d = self._durations[kind]
            paused += sum(d)
            parts.append(f"{words} {fmt_time(sum(d))} ({len(d)})")
        return (f"Wall time {fmt_time(total)}: training {fmt_time(max(total - paused, 0.0))} "
                f"(compilation included), {', '.join(parts)}.")


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


EVAL_PROGRESS_S = 30.0  # a long eval (ImageNet's 50,000 images on a CPU) says how far it is


class EvalProgress:
    """``progress(done_batches)`` after each eval batch: a line at most every ``every_s`` seconds
    (none for an eval shorter than that), with the batches and images done, the time spent and the
    ETA. ``sync`` (the sums so far) is waited for before a line: dispatch runs ahead of the device,
    and the line must count finished batches."""

    def __init__(self, n_examples: int, global_batch: int, label: str = "eval",
                 every_s: float | None = None, clock: Callable[[], float] = time.monotonic):
        self.n_examples, self.batch, self.label = n_examples, global_batch, label
        self.n_batches = order.num_eval_batches(n_examples, global_batch)  # the last padded
        self.every_s = EVAL_PROGRESS_S if every_s is None else every_s
        self.clock = clock
        self.start = self.last = clock()
        self.lines: list[str] = []  # what was logged, for the caller's tests

    def __call__(self, done: int, sync: Any = None) -> None:
        if self.clock() - self.last < self.every_s or done >= self.n_batches:
            return
        if sync is not None:
            import jax  # pylint: disable=import-outside-toplevel
            jax.block_until_ready(sync)
        now = self.clock()
        self.last = now
        spent = now - self.start
        images = min(done * self.batch, self.n_examples)
        line = (f"{self.label}: {done}/{self.n_batches} batches ({images:,} of "
                f"{self.n_examples:,} images), {fmt_time(spent)} so far, ETA "
                f"{fmt_time(spent * (self.n_batches - done) / max(done, 1))}")
        self.lines.append(line)
        from absl import logging  # pylint: disable=import-outside-toplevel
        logging.info(line)


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
