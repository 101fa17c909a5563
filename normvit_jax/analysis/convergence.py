"""Convergence of several methods over seeds: how soon each reaches a fraction of a reference
method's final accuracy (issue 26: "accelerates convergence").

The runs of one method (the seeds: runs whose configs agree on all but the seed and keys that
change nothing trained or evaluated, analysis/recipes.py; other recipes of a norm are other methods)
form one curve: the mean of their ``eval/top1`` at the steps all of them evaluated, with the min-max
over them. The threshold is ``target`` x the reference
method's mean final top-1. A run's reaching step is its first evaluated step at or above the
threshold; a method's is the mean over its runs, or none when a run never gets there. Runs whose
last evaluation comes before their own final step (still training or cut short: the row's
``final_step``, from its config; where that is not known, before the last evaluation of its
method's other runs) or that trained on other data than the reference (dataset, image size, class
count) are left out, with the reason. Finished runs of other lengths stay in.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import numpy as np

from normvit_jax.analysis import recipes
from normvit_jax.summaries import Series

TAG = "eval/top1"


class ConvergenceError(ValueError):
    """Bad input named by a flag (the report CLI prints it as one line and exits 2)."""


@dataclasses.dataclass
class MethodCurve:
    method: str
    label: str
    workdirs: list[str]        # its runs, in the order given
    finals: np.ndarray         # (runs,) last eval top-1 of each run
    reach: list[int | None]    # per run: first eval step >= threshold (None: never)
    steps: np.ndarray          # eval steps common to all runs
    mean: np.ndarray           # (steps,) mean top-1 over the runs
    low: np.ndarray            # min over the runs
    high: np.ndarray           # max over the runs
    images_per_s: float | None  # median over the runs of each run's median images/s

    @property
    def reach_mean(self) -> float | None:
        ok = [r for r in self.reach if r is not None]
        return float(np.mean(ok)) if ok and len(ok) == len(self.reach) else None


@dataclasses.dataclass
class Convergence:
    reference: str
    reference_label: str
    target: float              # the fraction of the reference's final top-1
    threshold: float           # target x the reference's mean final top-1
    methods: list[MethodCurve]
    left_out: list[tuple[str, str]]  # (workdir, why)
    # the kept runs' config.eval_every values (a step is known to that resolution); empty: unknown
    eval_every: list[int] = dataclasses.field(default_factory=list)


def first_reach(steps: np.ndarray, values: np.ndarray, threshold: float) -> int | None:
    hit = np.nonzero(np.asarray(values) >= threshold)[0]
    return int(np.asarray(steps)[hit[0]]) if len(hit) else None


def default_reference(methods: Sequence[str]) -> str | None:
    """'layernorm' where LN runs are present (one recipe or several: ``recipes_of``)."""
    return "layernorm" if recipes_of("layernorm", methods) else None


def recipes_of(reference: str, methods: Sequence[str]) -> list[str]:
    """The methods ``reference`` names: itself, or the recipes of it ('layernorm[...]')."""
    methods = list(dict.fromkeys(methods))
    if reference in methods:
        return [reference]
    return [m for m in methods if recipes.base_of(m) == reference and m != reference]


def resolve_reference(reference: str, methods: Sequence[str], labels: Mapping[str, str]) -> str:
    """The method key of --reference: a method of the runs, or a norm with one recipe; a norm
    with several recipes raises naming their keys (which run's final top-1 would be the
    target?), as a method no run has does."""
    found = recipes_of(reference, methods)
    if len(found) > 1:
        raise ConvergenceError(f"--reference={reference!r} is {len(found)} methods of these runs "
                               f"(recipes of {reference}); pass one of their keys: "
                               + ", ".join(found))
    check_reference(found[0] if found else reference, methods, labels)
    return found[0]


def check_reference(reference: str, methods: Sequence[str], labels: Mapping[str, str]) -> None:
    if reference not in methods:
        present = ", ".join(f"{m} ({labels[m]})" for m in dict.fromkeys(methods))
        raise ConvergenceError(f"--reference={reference!r} is not a method of these runs; "
                               f"methods present: {present}")


def check_target(target: float) -> None:
    if not (np.isfinite(target) and target > 0):
        raise ConvergenceError(f"--target={target!r} is not accepted; accepted: a fraction > 0 "
                               "of the reference's final top-1 (e.g. 0.95)")


def analyze(rows: Sequence[Mapping], scalars: Mapping[str, Mapping[str, Series]], reference: str,
            target: float = 0.95) -> Convergence | str:
    """rows: the report's run rows (workdir, run, method, label, images_per_s, data); scalars: each
    workdir's summaries. Runs whose ``data`` differs from the reference's first run's are left
    out. Returns the analysis, or why there is none (a sentence)."""
    check_target(target)
    labels = {r["method"]: r["label"] for r in rows}
    reference = resolve_reference(reference, [r["method"] for r in rows], labels)
    left_out, evals = [], []
    # the threshold is a fraction of the reference's accuracy on its data: a run trained on
    # other data (another dataset, image size or class count) was compared with it silently
    ref_data = next((r.get("data") for r in rows if r["method"] == reference), None)
    for r in rows:
        s = scalars[r["workdir"]].get(TAG)
        if r.get("data") != ref_data:
            left_out.append((r["workdir"], f"trained on {r.get('data')}, the reference "
                                           f"{labels[reference]} on {ref_data}"))
        elif s is None or not len(s.steps):
            left_out.append((r["workdir"], f"no {TAG} summaries"))
        else:
            evals.append((r, s))
    kept = []
    for r, s in evals:
        why = _unfinished(r, int(s.steps[-1]), evals)
        if why:
            left_out.append((r["workdir"], why))
        else:
            kept.append((r, s))
    ref = [s for r, s in kept if r["method"] == reference]
    if not ref:  # the reference's own runs' reasons: they are why there is no table
        why = "; ".join(f"{w}: {reason}" for w, reason in left_out
                        if any(r["workdir"] == w and r["method"] == reference for r in rows))
        return (f"no finished run of the reference {reference!r} ({labels[reference]})"
                + (f" ({why})" if why else ""))
    threshold = target * float(np.mean([s.values[-1] for s in ref]))
    methods = []
    for m in dict.fromkeys(r["method"] for r, _ in kept):
        group = [(r, s) for r, s in kept if r["method"] == m]
        steps = group[0][1].steps
        for _, s in group[1:]:
            steps = np.intersect1d(steps, s.steps)
        values = np.stack([s.values[np.searchsorted(s.steps, steps)] for _, s in group])
        ips = [r["images_per_s"] for r, _ in group if r.get("images_per_s") is not None]
        methods.append(MethodCurve(
            method=m, label=labels[m], workdirs=[r["workdir"] for r, _ in group],
            finals=np.asarray([s.values[-1] for _, s in group], np.float64),
            reach=[first_reach(s.steps, s.values, threshold) for _, s in group],
            steps=np.asarray(steps), mean=values.mean(0), low=values.min(0), high=values.max(0),
            images_per_s=float(np.median(ips)) if ips else None))
    every = sorted({int(r["eval_every"]) for r, _ in kept if r.get("eval_every")})
    return Convergence(reference, labels[reference], float(target), threshold, methods, left_out,
                       every)


def _unfinished(row: Mapping, last: int, evals: Sequence[tuple[Mapping, Series]]) -> str | None:
    """Why a run is left out as still training (or stopped early), or None: its last evaluation
    is before its own final step (``final_step`` of its row: config.total_steps, or num_epochs of
    its train split). A run evaluates at its final step, so a finished run's last evaluation is
    there; runs of other lengths are all finished (a 200-step run beside a 400-step one was left
    out). Where the final step is not known here (a num_epochs run whose dataset is not on this
    machine), its method's other runs (the same config, so the same length) stand in."""
    final = row.get("final_step")
    if final is not None:
        if last >= final:
            return None
        return (f"still training? its last evaluation is at step {last}, before its final step "
                f"{final} ({row.get('final_step_from')})")
    others = max((int(s.steps[-1]) for r, s in evals if r["method"] == row["method"]), default=0)
    if last >= others:
        return None
    return (f"still training? its last evaluation is at step {last}, its method's other runs' "
            f"at {others} (its final step is not known here)")


def reach_cell(c: MethodCurve) -> str:
    """The step; runs reaching it at different eval steps: the mean and each run's step,
    '333 (250, 500, 250)' (a bare 333 read as an evaluated step); else 'never (N runs)', or with
    some runs there 'not all runs (40, never)' (a bare '- (-)' read as a missing value, not as
    "never reached")."""
    if c.reach_mean is not None:
        if len(set(c.reach)) == 1:
            return str(c.reach[0])
        return f"{c.reach_mean:.0f} (" + ", ".join(map(str, c.reach)) + ")"
    if all(r is None for r in c.reach):
        n = len(c.reach)
        return f"never ({n} run{'s' if n != 1 else ''})"
    return "not all runs (" + ", ".join("never" if r is None else str(r) for r in c.reach) + ")"


def markdown(conv: Convergence) -> str:
    """The table: per method, runs, final top-1 (mean, min-max), steps to the threshold."""
    every = ("" if not conv.eval_every else
             f"; evals every {'/'.join(map(str, conv.eval_every))} steps")
    head = (f"| method | runs | final top-1 (mean) | min-max | steps to {100 * conv.target:g}% of "
            f"{conv.reference_label}'s final ({100 * conv.threshold:.1f}%{every}) "
            "| images/s (median) |")
    lines = [head, "|---|---|---|---|---|---|"]
    for c in conv.methods:
        ips = "–" if c.images_per_s is None else f"{c.images_per_s:.0f}"
        lines.append(f"| {c.label} | {len(c.workdirs)} | {' | '.join(final_cells(c.finals))} | "
                     f"{reach_cell(c)} | {ips} |")
    return "\n".join(lines) + "\n"


def final_cells(finals: np.ndarray) -> tuple[str, str]:
    """(mean, min-max) of the runs' final top-1 to 0.1 points, the mean with its n: one test
    image of a few hundred is ~0.3 points, so 96.90% over 3 seeds claimed a precision it has
    not; one run: its value and no range."""
    n = len(finals)
    if n == 1:
        return f"{100 * finals[0]:.1f}% (1 run)", "–"
    return (f"{100 * finals.mean():.1f}% (n={n})",
            f"{100 * finals.min():.1f}-{100 * finals.max():.1f}%")


NOTES = """
- One row per method: its runs (seeds: configs that differ in nothing else that is compared),
  each evaluated to its final step. final top-1: the last
  `eval/top1` of each run, mean (n: the runs) and min-max over the runs, to 0.1 points; a single
  run's value and no range.
- steps to the target: the first evaluated step at which a run's `eval/top1` is at or above the
  target fraction of the reference method's mean final top-1; where the runs differ, the mean
  over the method's runs (not itself an evaluated step) and each run's step in parentheses;
  'never (N runs)' when no run gets there, 'not all runs (...)' with each run's step ('never' for
  a run that does not) when some do. Evaluations are every `eval_every` steps (the column's
  header), so a step is known to that resolution.
- images/s: the median over the runs of the main table's images/s.
"""


def per_run(conv: Convergence) -> dict[str, dict]:
    """workdir -> its raw numbers (report.json's ``convergence`` of each row): the reference,
    target, threshold and its own reaching step, or why it was left out."""
    common = dict(reference=conv.reference, target=conv.target, threshold_top1=conv.threshold)
    out = {w: dict(common, steps_to_target=reach) for c in conv.methods
           for w, reach in zip(c.workdirs, c.reach)}
    out.update({w: dict(common, left_out=why) for w, why in conv.left_out})
    return out
