"""One compiled train step per phase of the step-scheduled norms (norms/progressive.py).

During a progressive hand-over both norms run; before it (warm-up) only N1 and after it only
N2 count. A single compiled step would compute N1 for the rest of the run with weight 0, or
branch on the step inside the step (on a GPU each ``lax.cond`` makes the host read its
predicate). The host knows the step number without asking the device, so it picks the step
compiled for the current phase instead: ``PhasedTrainStep.at(step)``. Each phase's step is the
run's model with every progressive norm told its phase (``phase=(first, end)``), compiled on
first use; a run without such norms has one phase and one step. A resumed run picks the same
phase for the same step, so resuming stays exact.
"""
from __future__ import annotations

import bisect
import dataclasses
from typing import Any, Callable

from flax.core import FrozenDict

from normvit_jax import models
from normvit_jax.norms import registry
from normvit_jax.norms.progressive import Progressive


def _scheduled(cfg: Any) -> bool:
    return cfg is not None and registry.name_of(cfg) == "progressive"


def _norm_configs(spec: Any) -> list:
    return [*spec.slot_norms, getattr(spec, "stem_norm", None)]


def phase_starts(spec: Any) -> tuple[int, ...]:
    """The first step of every phase of the model's step-scheduled norms, from 0 (just (0,) for
    a model without them)."""
    starts = {0}
    for cfg in filter(_scheduled, _norm_configs(spec)):
        starts |= Progressive.phase_starts(registry.as_dict(cfg))
    return tuple(sorted(starts))


def spec_for_phase(spec: Any, phase: tuple[int, int | None]) -> Any:
    """``spec`` with ``phase`` in the config of every progressive norm (same variables)."""
    def told(cfg: Any) -> Any:
        return FrozenDict({**registry.as_dict(cfg), "phase": phase}) if _scheduled(cfg) else cfg
    changes: dict[str, Any] = {
        "norm": told(spec.norm),
        "norm_overrides": tuple((k, told(v)) for k, v in spec.norm_overrides)}
    if getattr(spec, "stem_norm", None) is not None:
        changes["stem_norm"] = told(spec.stem_norm)
    return dataclasses.replace(spec, **changes)


class PhasedTrainStep:
    """``at(step)``: the train step compiled for the phase holding ``step`` (the number of steps
    done, as ``state.step``). Called directly it is the step for any phase (the norms read the
    step number on the device), for callers that do not track the step."""

    def __init__(self, make: Callable[[Any], Callable], model: Any) -> None:
        """``make(model) -> jitted train_step(state, batch)``."""
        self._make, self._model = make, model
        self.starts = phase_starts(model.spec)
        self._any = make(model)
        self._by_phase: dict[int, Callable] = {}

    def __call__(self, state: Any, batch: Any) -> Any:
        return self._any(state, batch)

    def at(self, step: int) -> Callable:
        if len(self.starts) == 1:
            return self._any
        i = bisect.bisect_right(self.starts, step) - 1
        if i not in self._by_phase:
            end = self.starts[i + 1] if i + 1 < len(self.starts) else None
            spec = spec_for_phase(self._model.spec, (self.starts[i], end))
            self._by_phase[i] = self._make(models.create(spec))
        return self._by_phase[i]
