"""Comparison report of several runs: a markdown table and training curves on shared axes, a
convergence table and figure per method, plus the attention distances, token statistics and norm
gates of every run on shared axes.

    python -m normvit_jax.analysis.report runs/ln runs/dtn runs/un --out=report/
    python -m normvit_jax.analysis.report runs/{ln,repbn}_s{0,1,2} --out=report/ --no_attention \\
        --reference=layernorm --target=0.95

Reads each workdir's TensorBoard summaries, config.json and newest checkpoint, so it works on runs
made on other machines (a run whose prepared dataset is gone here takes its class count from the
checkpoint). Writes report.md, report.json (the table's raw numbers), curves_steps.png,
curves_wall.png, convergence.png (only with a convergence table) and (unless --no_attention, which
also skips reading eval data) the files of ``attention.write_summaries``. --tags plots any other
logged scalars (e.g. the eval-time token statistics 'tokens/encoderblock_0/LayerNorm_0/in/max_abs')
against steps.

Methods (analysis/recipes.py): ``colors.method_of`` keys a run by its normalization (the norm, or
'progressive:N1->N2', with '+parts' for per-slot overrides and other normalization options, e.g.
'layernorm+block_1:rmsnorm'); runs of one such key pool as seeds only when their config.json files
agree on every key but the seed and ``recipes.NOT_COMPARED`` (logging and checkpoint cadence, mesh,
threads, data_dir, ...; eval_every is compared). Runs that differ in other keys are separate
methods keyed with those keys, e.g. 'layernorm[optimizer.learning_rate=0.001]' (label
'LN [lr=0.001]'); report.json's rows give them as ``recipe`` and report.md names the keys that
differ and how each was read.

Convergence (analysis/convergence.py): per method the mean eval/top1 curve and its min-max over the
runs, the final top-1 (mean, min-max), and the first evaluated step at which each run reaches
--target x the --reference method's mean final top-1 (mean over the runs; 'never (N runs)', or
'not all runs (...)' with each run's step, when they do not all get there; where the runs
get there at different steps the mean is followed by each run's step, '333 (250, 500, 250)').
--reference takes a method key (a norm with one recipe also by its plain key); it defaults to
layernorm when such runs are present (else, as without a finished run of the reference or with
several LN recipes, no convergence table or figure: report.md says why, listing the keys to pass,
report.json's ``convergence`` is null); a reference no run has, or a norm with several recipes,
exits 2 naming the method keys. Runs still training (last evaluation before their own final step:
config.total_steps, or num_epochs of their train split) or trained on other data than the
reference are left out of it, with the reason printed. The table goes to stdout
and report.md; each row of report.json gets ``convergence``: the reference, target, threshold_top1
and its steps_to_target (null: never), or why it was left out.

A run whose event file is damaged (truncated, zeroed) keeps its row, read up to the damage, and is
noted (stderr and report.md: "note W: the event file ... read up to step N", summaries.read_run).
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any, NamedTuple, Sequence

import jax
import numpy as np

from normvit_jax import checkpoints, cli, data, models, run_config, tool_flags
from normvit_jax import summaries as events  # the TensorBoard reader (read_run, Series)
from normvit_jax.analysis import (attention, capture, colors, convergence, figures, flops,
                                  plots_convergence, plots_curves, recipes, tables)

FLOPS_SOURCE = "XLA cost analysis of the compiled eval forward (batch 1, CPU backend)"


def _last(s: events.Series | None) -> float | None:
    return float(s.values[-1]) if s is not None and len(s.values) else None


def _best(s: events.Series | None) -> float | None:
    return float(np.max(s.values)) if s is not None and len(s.values) else None


class ModelInput(NamedTuple):
    """The fields of a DataSpec that fix a run's model and its input (``capture.config_key``,
    ``capture.build_model``): enough for the model column and the FLOPs when the run's dataset
    cannot be opened here."""
    name: str
    num_classes: int
    image_shape: tuple[int, int, int]


def data_spec_of(workdir: str, config: Any, variables: Any) -> data.DataSpec | ModelInput:
    """The run's DataSpec; if its dataset is not readable here (a prepared ``data.data_dir`` that
    is gone), the class count from the checkpoint's head instead, with a printed note."""
    try:
        return data.resolve_data_spec(config)
    except Exception as e:  # noqa: BLE001  (any reason the dataset cannot be resolved)
        n = int(np.shape(variables["params"]["head"]["bias"])[-1])
        size = int(config.data.image_size)
        print(f"report: {workdir}: dataset {config.data.name!r} not readable here "
              f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
              f"{n} classes from the checkpoint's head", file=sys.stderr)
        return ModelInput(str(config.data.name), n, (size, size, 3))


def model_name(config: Any, data_spec: data.DataSpec | ModelInput) -> str:
    s = models.spec_of(config, data_spec.num_classes)
    size = f"d{s.depth} w{s.hidden_size} h{s.num_heads} p{s.patch_size}"
    name = s.variant or "custom"
    return f"ViT-{name} ({size}, {data_spec.image_shape[0]}px {data_spec.name})"


def steady_throughput(ips: events.Series | None, start_steps: Sequence[int]) -> np.ndarray:
    """The images/s values without the first log interval of each (re)start of the loop: it
    holds that process's compilation where the step was not timed first, and the first steps
    after it run slower (after a resume the restart's first interval was kept,
    pulling the median down on a run restarted often). A run with that interval alone keeps it."""
    if ips is None or not len(ips.values):
        return np.zeros(0)
    drop = {0}
    for s in start_steps:
        after = np.nonzero(ips.steps > s)[0]
        if len(after):
            drop.add(int(after[0]))
    keep = np.array([i not in drop for i in range(len(ips.values))])
    return ips.values[keep] if keep.any() else ips.values


def final_step(config: Any) -> tuple[int | None, str | None]:
    """(the step the run trains to, where that comes from): config.total_steps, else num_epochs
    x the steps per epoch of its train split (``build.total_steps``, as training counts them);
    (None, None) when that split cannot be opened here (a dataset not on this machine)."""
    from normvit_jax.train import build  # pylint: disable=import-outside-toplevel
    if config.get("total_steps"):
        return int(config.total_steps), "config.total_steps"
    try:
        n = data.train_examples(config)
    except Exception:  # noqa: BLE001  (any reason the split cannot be read here)
        return None, None
    return (build.total_steps(config, n // int(config.batch_size)),
            f"config.num_epochs={config.num_epochs}")


def run_row(workdir: str, summaries: events.RunSummaries) -> dict:
    """One table row: numbers from the summaries, the config and the newest checkpoint."""
    variables, config = checkpoints.load_variables(workdir)
    ds = data_spec_of(workdir, config, variables)
    sc = summaries.scalars
    steps = [int(s.steps[-1]) for t, s in sc.items() if t.startswith(("train/", "eval/")) and len(s.steps)]
    ips_vals = steady_throughput(sc.get("train/examples_per_sec"), summaries.start_steps)
    method = colors.method_of(config)  # write_report adds the recipe (analysis/recipes.py)
    folded_params, folded_flops = folded_size(config, ds, variables)
    final, final_from = final_step(config)
    return dict(
        run=tables.run_name(workdir), workdir=str(workdir), method=method, label=colors.label(method),
        recipe={},
        model=model_name(config, ds),
        data=f"{ds.name} {ds.image_shape[0]}px, {ds.num_classes} classes",
        params=int(sum(np.size(x) for x in jax.tree.leaves(variables["params"]))),
        flops_per_image=flops.xla_flops_of_config(config, ds, variables),
        size_of="trained (unfolded) model",  # params and FLOPs; the folded_* keys: after reparam
        folded_params=folded_params, folded_flops_per_image=folded_flops,
        analytic_flops_per_image=flops.analytic_flops(models.spec_of(config, ds.num_classes),
                                                      int(config.data.image_size)),
        best_top1=_best(sc.get("eval/top1")), final_top1=_last(sc.get("eval/top1")),
        best_top5=_best(sc.get("eval/top5")), final_top5=_last(sc.get("eval/top5")),
        final_eval_loss=_last(sc.get("eval/loss")),
        weight_ema=float(config.get("ema_decay", 0) or 0) > 0,  # --weights=ema is possible
        steps=max(steps) if steps else None, final_step=final, final_step_from=final_from,
        eval_every=int(config.eval_every) if config.get("eval_every") else None,
        label_smoothing=float(config.get("label_smoothing") or 0),  # train/loss's objective
        wall_time_s=summaries.wall_time_s,
        images_per_s=float(np.median(ips_vals)) if len(ips_vals) else None)


_FOLDED: dict[str, tuple[int | None, float | None]] = {}


def folded_size(config: Any, ds: Any, variables: Any) -> tuple[int | None, float | None]:
    """(params, FLOPs per image) of the run's model after ``reparam.fold`` (done in memory), or
    (None, None) when no slot folds (LN) or the placement does not (post-norm): a RepBN run's
    table numbers are its trained model's, with the BN branch the deployed model drops."""
    from normvit_jax import norms, reparam  # pylint: disable=import-outside-toplevel
    key = capture.config_key(config, ds)
    if key not in _FOLDED:
        spec = models.spec_of(config, ds.num_classes)
        slots = [n for n in spec.slot_norms if norms.name_of(n) != "identity"]
        _FOLDED[key] = (None, None)
        if spec.norm_placement == "pre" and any(reparam.foldable(n) or reparam.splittable(n)
                                                for n in slots):
            new_spec, folded, rep = reparam.fold(spec, variables)
            if rep.folded:
                _FOLDED[key] = (
                    int(sum(np.size(x) for x in jax.tree.leaves(folded["params"]))),
                    flops.xla_flops(models.create(new_spec, ds.num_classes), folded,
                                    int(ds.image_shape[0])))
    return _FOLDED[key]


def _si(x: float) -> str:
    for div, unit in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if x >= div:
            return f"{x / div:.3g} {unit}"
    return f"{x:.3g}"


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.2f}%"


def _time(s: float) -> str:
    s = int(round(s))
    h, rem = divmod(s, 3600)
    return f"{h}h{rem // 60:02d}m" if h else f"{rem // 60}m{rem % 60:02d}s"


COLUMNS = ("method", "run", "model", "params", "FLOPs/image", "best top-1", "final top-1",
           "best top-5", "final top-5", "steps", "wall time", "images/s",
           "folded params / FLOPs")


def markdown_table(rows: Sequence[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        cells = (r["label"], r["run"], r["model"], f"{r['params']:,}", _si(r["flops_per_image"]),
                 _pct(r["best_top1"]), _pct(r["final_top1"]), _pct(r["best_top5"]),
                 _pct(r["final_top5"]), "–" if r["steps"] is None else str(r["steps"]),
                 _time(r["wall_time_s"]),
                 "–" if r["images_per_s"] is None else f"{r['images_per_s']:.0f}",
                 "–" if r.get("folded_params") is None else
                 f"{r['folded_params']:,} / {_si(r['folded_flops_per_image'])}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


NOTES = f"""
- FLOPs/image: {FLOPS_SOURCE}; a multiply-add counts 2
  (report.json also has the analytic count of the matmuls, `analytic_flops_per_image`).
- best/final top-1 and top-5: the maximum and the last value of `eval/top1`, `eval/top5`.
- wall time: sum over the run's event files
  (one per process) of last minus first event time; the first event is written before compiling,
  so compilation is included (Python/JAX start-up is not); idle time between restarts is not.
- images/s: median of `train/examples_per_sec` over the log intervals, the first of the run and of
  each restart left out (it holds the compilation where the step was not timed first).
- params, FLOPs/image: of the trained (unfolded) model, from the newest checkpoint (report.json:
  `size_of`). folded params / FLOPs: the same model after `python -m normvit_jax.reparam` folds
  its inference-time affine norms (BN, RepBN, UN, ...) into the next Dense, computed in memory;
  `–` where nothing folds. A reparam output folder is a model, not a run: give the report the run.
- steps: the run's last step with any `train/` or `eval/` summary (its training length;
  report.json's `final_step`: the step its config trains to).
- method: runs of one norm pool as seeds only when their config.json files agree on all but the
  seed and keys that change neither what is trained nor how it is evaluated (log and checkpoint
  cadence, mesh, threads, data_dir, ...); others are separate methods named by the keys that
  differ, `LN [lr=0.001]` (report.json: `recipe`).
"""


def write_report(workdirs: Sequence[str], out: str, no_attention: bool = False, images: int = 8,
                 stat_images: int = 64, tags: Sequence[str] = (), reference: str | None = None,
                 target: float = 0.95, weights: str | None = None) -> list[str]:
    """Writes the report of ``workdirs`` into ``out`` and returns the paths written. reference,
    target: the convergence table and figure (module docstring); reference None: 'layernorm'
    when such runs are present, else no convergence section. weights: --weights of the attention
    analysis (``checkpoints.choose_weights``; a run without an EMA is skipped there). Raises
    ConvergenceError for a reference no run has or a target <= 0, before anything is written."""
    convergence.check_target(target)
    if weights == "ema" and not no_attention:
        _check_ema(workdirs)  # before reading the runs: every one would fail the same way
    rows, summaries, skipped = _read_runs(_distinct(workdirs))
    workdirs = [r["workdir"] for r in rows]
    for r, name in zip(rows, tables.run_names(workdirs)):  # a/ln b/ln: not both 'ln'
        r["run"] = name
    if not rows:  # one line (main): each run and why
        raise ValueError("no run could be read: " + "; ".join(f"{w}: {why}" for w, why in skipped))
    for w, why in skipped:
        _skip(w, why)
    notes = [(w, line) for w in workdirs for line in summaries[w].damaged]
    for w, line in notes:  # the run keeps its row, read up to the damage
        print(f"report: note {w}: {line}", file=sys.stderr)
    split = _split_recipes(rows)
    conv = _convergence(rows, summaries, reference, target)  # raises before anything is written
    _check_tags(tags, [summaries[w].scalars for w in workdirs])
    os.makedirs(out, exist_ok=True)
    print(f"Comparison of runs:\n{markdown_table(rows)}\n{split.line()}")
    paths = [os.path.join(out, "report.md"), os.path.join(out, "report.json")]
    pal = colors.palette([r["method"] for r in rows])  # one colour per method, recipes too
    section = _convergence_section(conv, rows, out, paths, pal)
    with open(paths[0], "w") as f:
        f.write("# Comparison of runs\n\n" + markdown_table(rows) + "\n" + split.line()
                + NOTES[1:]
                + "".join(f"- skipped {w}: {why}\n" for w, why in skipped)
                + "".join(f"- note {w}: {line}\n" for w, line in notes)
                + "\n## Convergence\n\n" + section)
    with open(paths[1], "w") as f:
        json.dump(rows, f, indent=2)
    dup = len({r["method"] for r in rows}) < len(rows)
    curves = [(f"{r['label']} ({r['run']})" if dup else r["label"], pal[r["method"]],
               summaries[w].scalars) for r, w in zip(rows, workdirs)]
    for x, name in (("step", "curves_steps.png"), ("elapsed", "curves_wall.png")):
        fig = plots_curves.curves_figure(curves, x, "Training curves per normalizer, against "
                                         + ("steps" if x == "step" else "wall time"),
                                         plots_curves.panels([r["label_smoothing"] for r in rows]))
        paths.append(figures.save(fig, os.path.join(out, name)))
    if tags:
        panels = [(t, t, "value", 1.0) for t in tags]
        fig = plots_curves.curves_figure(curves, "step", "Logged scalars per normalizer", panels)
        paths.append(figures.save(fig, os.path.join(out, "tags.png")))
    if not no_attention:
        runs = []
        for w, r in zip(_progress(workdirs, "attention analysis"), rows):
            if weights == "ema" and not r["weight_ema"]:
                _skip(w, "no attention analysis: --weights=ema, and the run keeps no EMA of its "
                         "weights (config.ema_decay is 0)")
                continue
            try:
                ra = attention.analyze_run(w, images, stat_images, weights=weights)
            except Exception as e:  # noqa: BLE001  (one run's eval data or model must not end all)
                _skip(w, f"attention analysis failed ({type(e).__name__}: {e})")
                continue
            ra.run = dataclasses.replace(ra.run, method=r["method"])  # the recipe's key: CSVs
            runs.append(ra)
        if runs:
            paths += attention.write_summaries(runs, out, "All runs", pal)
    return paths


class WeightsError(ValueError):
    """--weights=ema where no run kept a weight EMA (one line, exit 2)."""


def _has_ema(workdir: str) -> bool | None:
    """Whether the run's config.json asks for a weight EMA; None when it cannot be read (the
    run is then named by _read_runs)."""
    try:
        saved = run_config.read_saved(os.path.join(str(workdir), "config.json"))
    except Exception:  # noqa: BLE001
        return None
    return float(saved.get("ema_decay") or 0) > 0


def _check_ema(workdirs: Sequence[str]) -> None:
    """Raises WeightsError when none of the readable runs keeps a weight EMA (as the attention
    tool refuses --weights=ema of such a run): each run failed with a NoEmaError line."""
    has = [h for h in map(_has_ema, workdirs) if h is not None]
    if has and not any(has):
        raise WeightsError("--weights=ema: none of the runs keeps an EMA of its weights "
                           "(config.ema_decay is 0); leave --weights out for their weights, or "
                           "use --no_attention")


class TagsError(ValueError):
    """A --tags tag that none of the runs logged (its panel would be empty)."""


def _check_tags(tags: Sequence[str], scalars: Sequence[dict]) -> None:
    """Raises TagsError, before anything is written, for a tag no run logged, naming the closest
    logged tags (a misspelt tag drew an empty panel in tags.png, and nothing said so)."""
    import difflib  # pylint: disable=import-outside-toplevel
    logged = sorted({t for sc in scalars for t in sc})
    for t in tags:
        if t not in logged:
            close = difflib.get_close_matches(t, logged, n=3, cutoff=0.5)
            hint = (f"the closest: {', '.join(close)}" if close else
                    f"they log e.g. {', '.join(logged[:3])}")
            raise TagsError(f"--tags: {t!r} is logged by none of the runs; {hint}")


def _split_recipes(rows: list[dict]) -> recipes.Recipes:
    """Splits each method's runs by recipe (analysis/recipes.py): a row's method, label and
    ``recipe`` become its recipe's where the runs of its norm differ in compared config keys."""
    split = recipes.split([(r["workdir"], r["method"],
                            run_config.read_saved(checkpoints.config_path(r["workdir"])))
                           for r in rows])
    for r in rows:
        r["method"] = split.method[r["workdir"]]
        r["label"], r["recipe"] = colors.label(r["method"]), split.recipe[r["workdir"]]
    return split


def _convergence_section(conv: convergence.Convergence | str, rows: list[dict], out: str,
                         paths: list[str], pal: dict) -> str:
    """report.md's convergence section; adds each row's ``convergence`` (report.json), prints the
    table and writes convergence.png (appended to ``paths``)."""
    per_run = convergence.per_run(conv) if isinstance(conv, convergence.Convergence) else {}
    for r in rows:
        r["convergence"] = per_run.get(r["workdir"])  # None: no convergence analysis
    if not isinstance(conv, convergence.Convergence):
        print(f"report: no convergence table: {conv}", file=sys.stderr)
        return f"Not computed: {conv}.\n"
    # no-break spaces inside each model name: the title wrapped mid-name ('8px / digits')
    models = ", ".join(dict.fromkeys(r["model"].replace(" ", "\u00a0") for r in rows
                                     if "steps_to_target" in (r["convergence"] or {})))
    fig = plots_convergence.convergence_figure(
        conv, f"Eval top-1 against steps, mean over each method's runs: {models}", pal)
    paths.append(figures.save(fig, os.path.join(out, "convergence.png")))
    table = convergence.markdown(conv)
    print(f"Convergence (reference {conv.reference}, target {conv.target:g}):\n{table}")
    return (table + convergence.NOTES
            + "".join(f"- left out {w}: {why}\n" for w, why in conv.left_out)
            + "\n![convergence](convergence.png)\n")


def _convergence(rows: Sequence[dict], summaries: dict, reference: str | None,
                 target: float) -> convergence.Convergence | str:
    """The convergence analysis, or why there is none; runs it leaves out are printed."""
    methods = list(dict.fromkeys(r["method"] for r in rows))
    ref = reference or convergence.default_reference(methods)
    if ref is None:
        return (f"no layernorm runs and no --reference; methods present: {', '.join(methods)}")
    several = convergence.recipes_of(ref, methods)
    if reference is None and len(several) > 1:  # which LN recipe's final top-1 is the target?
        return (f"no --reference, and the {ref} runs are {len(several)} methods; pass one of "
                f"their keys: " + ", ".join(f"--reference={m}" for m in several))
    conv = convergence.analyze(rows, {w: s.scalars for w, s in summaries.items()}, ref, target)
    if isinstance(conv, convergence.Convergence):
        for w, why in conv.left_out:
            print(f"report: convergence: leaving out {w}: {why}", file=sys.stderr)
    return conv


def _progress(workdirs: Sequence[str], what: str) -> Any:
    """A bar on stderr over the runs, only on a terminal (tqdm's disable=None): reading the
    runs and their attention analysis take tens of seconds, which passed without a word; a
    pipe or a test's capture gets the lines alone."""
    from tqdm import tqdm  # pylint: disable=import-outside-toplevel
    return tqdm(workdirs, desc=what, unit="run", file=sys.stderr, dynamic_ncols=True,
                leave=False, disable=None)


def _skip(workdir: str, why: str) -> None:
    print(f"report: skipping {workdir}: {why}", file=sys.stderr)


def _distinct(workdirs: Sequence[str]) -> list[str]:
    """The workdirs with each run once: a run given twice (``runs/ln runs/ln/``, overlapping
    globs) had two rows and counted as two seeds of its method in the convergence mean."""
    seen: dict[str, str] = {}
    for w in workdirs:
        key = os.path.realpath(w)
        if key in seen:
            print(f"report: {w} is the same run as {seen[key]}; counted once", file=sys.stderr)
        else:
            seen[key] = str(w)
    return list(seen.values())


def _read_runs(workdirs: Sequence[str]) -> tuple[list[dict], dict, list[tuple[str, str]]]:
    """The rows of the runs that can be read; a run that failed (no config.json, no checkpoint,
    unreadable summaries) is left out with the reason (printed by write_report) instead of
    ending the whole report."""
    rows, summaries, skipped = [], {}, []
    for w in _progress(workdirs, "reading runs"):
        try:
            checkpoints.require_run(w)  # names what is missing and the command that makes it
            summaries[str(w)] = events.read_run(w)
            rows.append(run_row(w, summaries[str(w)]))
        except Exception as e:  # noqa: BLE001
            why = str(e) if isinstance(e, checkpoints.RunNotFoundError) else \
                f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            skipped.append((str(w), why))
    return rows, summaries, skipped


def main(argv: Sequence[str] | None = None) -> int:
    from normvit_jax import logs
    logs.quiet_library_logs()
    ap = tool_flags.Parser("python -m normvit_jax.analysis.report", __doc__)
    ap.add_argument("workdirs", nargs="+", help="run workdirs (config.json, checkpoints/, events)")
    ap.add_argument("--out", required=True, help="folder for report.md, report.json and the PNGs")
    ap.add_argument("--no_attention", action="store_true",
                    help="skip attention distances, token statistics and gates (needs no eval data)")
    ap.add_argument("--images", type=tool_flags.positive_int, default=8,
                    help="eval images per run for the analysis")
    ap.add_argument("--stat_images", type=tool_flags.positive_int, default=64,
                    help="eval images averaged for distances and token statistics")
    ap.add_argument("--tags", default="", help="comma list of other scalar tags to plot vs steps")
    ap.add_argument("--reference", default=None,
                    help="method whose mean final top-1 sets the convergence target, e.g. "
                         "layernorm, repbn, progressive:layernorm->repbn, or one recipe's key "
                         "as report.json has it, 'layernorm[optimizer.learning_rate=0.001]' "
                         "(default: layernorm when present, else no convergence table)")
    ap.add_argument("--target", type=float, default=0.95,
                    help="fraction of the reference's mean final top-1 each method must reach")
    tool_flags.add_weights(ap)  # the attention analysis's weights (the table reads summaries)
    args = ap.parse_args(argv)
    tags = [t for t in args.tags.split(",") if t.strip()]
    try:  # before the work, not a traceback after it
        tool_flags.check_output("out", args.out, folder=True)
    except ValueError as e:
        ap.error(str(e))
    # any other known error (cli.EXIT_CODES) and Ctrl-C: one line and its exit code, as the
    # other tools (docs/faults.md)
    with cli.tool_errors(ap.prog):
        try:
            paths = write_report(args.workdirs, args.out, args.no_attention, args.images,
                                 args.stat_images, tags, args.reference, args.target, args.weights)
        except ValueError as e:
            if not (isinstance(e, (convergence.ConvergenceError, TagsError, WeightsError))
                    or str(e).startswith("no run could be read")):
                raise
            print(f"error: {e}", file=sys.stderr)
            return 2
    print("\n".join(paths))
    return 0


if __name__ == "__main__":
    from normvit_jax import logs as _logs  # absl's log format, as main.py's
    _logs.absl_format()
    sys.exit(main())
