"""The report's convergence table and figure (issue 26): hand-written eval curves of two methods
over two seeds, checked against a hand computation; method keys of the progressive norms."""
from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.summary.writer.record_writer import RecordWriter
from tensorboard.util import tensor_util

from benchmarks import demo_table
from configs import vit_dynamic_feature, vit_progressive
from normvit_jax import checkpoints, data, models, run_config
from normvit_jax.analysis import colors, convergence, report
from normvit_jax.summaries import Series
from tests.conftest import tiny_demo_config

META = summary_pb2.SummaryMetadata(
    plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars"))

# eval/top1 at steps 10, 20, 30, 40 (float32-exact). Target 0.9 x LN's mean final
# (0.875 + 0.75) / 2 = 0.8125 -> threshold 0.73125.
CURVES = {
    "ln_s0": ("layernorm", [0.25, 0.625, 0.75, 0.875]),   # reaches it at step 30
    "ln_s1": ("layernorm", [0.5, 0.75, 0.875, 0.75]),     # at step 20 -> LN: mean 25
    "dyt_s0": ("dyt", [0.125, 0.25, 0.5, 0.75]),          # at step 40
    "dyt_s1": ("dyt", [0.25, 0.5, 0.625, 0.625]),         # never -> DyT: 'not all runs (40, never)'
}


def _top1(*finals) -> str:
    """The table's final top-1 cells of runs ending at ``finals``: the mean with n to 0.1 points
    and the min-max (96.90% over 3 seeds claimed a precision a 355-image test split has not);
    one run: its value, no range."""
    if len(finals) == 1:
        return f"{100 * finals[0]:.1f}% (1 run) | –"
    return (f"{100 * sum(finals) / len(finals):.1f}% (n={len(finals)}) | "
            f"{100 * min(finals):.1f}-{100 * max(finals):.1f}%")


def _write_events(workdir: str, steps, values) -> None:
    with open(os.path.join(workdir, "events.out.tfevents.100.host.1.0.v2"), "wb") as f:
        w = RecordWriter(f)
        w.write(event_pb2.Event(wall_time=100.0, file_version="brain.Event:2").SerializeToString())
        for step, v in zip(steps, values):
            val = summary_pb2.Summary.Value(tag="eval/top1", metadata=META,
                                            tensor=tensor_util.make_tensor_proto(np.float32(v)))
            w.write(event_pb2.Event(wall_time=100.0 + step, step=step,
                                    summary=summary_pb2.Summary(value=[val])).SerializeToString())


def _fake_run(workdir: str, norm: str, steps, values, **overrides) -> None:
    """config.json, an initialised (untrained) checkpoint and the given eval/top1 summaries; a
    40-step run unless ``overrides`` (dotted config keys, e.g. 'optimizer.learning_rate') say."""
    cfg = tiny_demo_config(**{"total_steps": 40, "eval_every": 10, **overrides})
    cfg.model.depth = 1
    cfg.model.norm = {"name": norm}
    ds = data.resolve_data_spec(cfg)
    params = models.create(cfg, ds.num_classes).init(
        jax.random.PRNGKey(0), jnp.zeros((1, *ds.image_shape)), train=False)["params"]
    os.makedirs(workdir)
    mngr = checkpoints.make_manager(workdir, async_save=False)
    checkpoints.save(mngr, 40, {"params": params, "step": 40})
    mngr.wait_until_finished()
    run_config.write_config(cfg, workdir)
    _write_events(workdir, steps, values)


@pytest.fixture(scope="module")
def fake_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("conv")
    for name, (norm, values) in CURVES.items():
        _fake_run(str(root / name), norm, [10, 20, 30, 40], values)
    # Still training: evaluated up to step 20 only (and above the target: it must not count).
    _fake_run(str(root / "ln_s2"), "layernorm", [10, 20], [0.875, 1.0])
    return root


def test_report_convergence_table_equals_the_hand_computation(fake_runs, tmp_path, capsys):
    runs = [str(fake_runs / n) for n in ("ln_s0", "ln_s1", "ln_s2", "dyt_s0", "dyt_s1")]
    out = str(tmp_path / "rep")
    assert report.main([*runs, f"--out={out}", "--no_attention", "--target=0.9"]) == 0
    captured = capsys.readouterr()
    assert (f"leaving out {fake_runs / 'ln_s2'}: still training? its last evaluation is at "
            "step 20, before its final step 40 (config.total_steps)") in captured.err
    md = open(os.path.join(out, "report.md")).read()
    # the mean step 25 is no evaluated step: each run's step follows it
    ln_row = f"| LN | 2 | {_top1(0.875, 0.75)} | 25 (30, 20) | – |"
    dyt_row = f"| DyT | 2 | {_top1(0.75, 0.625)} | not all runs (40, never) | – |"
    assert "steps to 90% of LN's final (73.1%; evals every 10 steps)" in md
    assert ln_row in md and dyt_row in md
    assert ln_row in captured.out and dyt_row in captured.out  # printed too
    main_table = demo_table.comparison_table(md)  # what docs/analysis.md copies: runs only
    assert len(main_table) == 2 + 5 and main_table[0].startswith("| method | run | model |")
    # the comparison itself is printed too (only the convergence table and the paths were)
    assert captured.out.startswith("Comparison of runs:\n" + "\n".join(main_table) + "\n")
    assert os.path.getsize(os.path.join(out, "convergence.png")) > 10_000
    rows = {r["run"]: r["convergence"] for r in json.load(open(os.path.join(out, "report.json")))}
    assert {k: rows[k]["steps_to_target"] for k in CURVES} == {
        "ln_s0": 30, "ln_s1": 20, "dyt_s0": 40, "dyt_s1": None}
    assert rows["ln_s0"]["threshold_top1"] == pytest.approx(0.9 * 0.8125, rel=1e-7)
    assert rows["ln_s0"]["reference"] == "layernorm" and rows["ln_s0"]["target"] == 0.9
    assert rows["ln_s2"]["left_out"].startswith("still training?")
    # DyT as the reference: 0.95 x (0.75 + 0.625) / 2 = 0.653125; LN s0 0.75 at step 30, s1 at 20.
    assert report.main([*runs, f"--out={out}2", "--no_attention", "--reference=dyt"]) == 0
    md = open(os.path.join(out + "2", "report.md")).read()
    assert "steps to 95% of DyT's final (65.3%; evals every 10 steps)" in md
    assert f"| LN | 2 | {_top1(0.875, 0.75)} | 25 (30, 20) |" in md
    assert f"| DyT | 2 | {_top1(0.75, 0.625)} | 40 |" not in md  # s1 ends at 0.625 < 0.653
    assert f"| DyT | 2 | {_top1(0.75, 0.625)} | not all runs (40, never) |" in md


def test_report_without_a_reference_writes_no_convergence_table_or_figure(fake_runs, tmp_path,
                                                                          capsys):
    """No LN run and no --reference, or no finished run of the reference: report.md says why
    under Convergence, report.json's rows have convergence null, and no convergence.png is
    written (there would be no target line to draw); the rest of the report is written, exit 0."""
    dyt = [str(fake_runs / n) for n in ("dyt_s0", "dyt_s1")]
    still = [str(fake_runs / "ln_s2"), str(fake_runs / "dyt_s0")]  # LN evaluated to step 20 only
    for runs, why in ((dyt, "no layernorm runs and no --reference; methods present: dyt"),
                      (still, "no finished run of the reference 'layernorm' (LN) ("
                              f"{fake_runs / 'ln_s2'}: still training? its last evaluation is "
                              "at step 20, before its final step 40 (config.total_steps))")):
        out = str(tmp_path / str(len(why)))
        assert report.main([*runs, f"--out={out}", "--no_attention"]) == 0
        assert f"report: no convergence table: {why}" in capsys.readouterr().err
        assert sorted(os.listdir(out)) == ["curves_steps.png", "curves_wall.png", "report.json",
                                           "report.md"]
        assert f"## Convergence\n\nNot computed: {why}.\n" in open(f"{out}/report.md").read()
        assert [r["convergence"] for r in json.load(open(f"{out}/report.json"))] == [None, None]


def test_report_bad_reference_or_target_is_one_line(fake_runs, tmp_path, capsys):
    runs = [str(fake_runs / n) for n in ("ln_s0", "dyt_s0")]
    assert report.main([*runs, f"--out={tmp_path}/r", "--no_attention", "--reference=repbn"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --reference='repbn' is not a method of these runs; methods present: "
                   "layernorm (LN), dyt (DyT)"]
    assert not os.path.exists(f"{tmp_path}/r")  # nothing written
    assert report.main([*runs, f"--out={tmp_path}/r", "--target=-1"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: --target=-1.0 is "
                                                                        "not accepted")


def test_mean_curve_over_the_steps_every_run_evaluated():
    def series(steps, values):
        steps = np.asarray(steps)
        return {"eval/top1": Series(steps, np.asarray(values, np.float64), steps * 1.0, steps * 1.0)}
    rows = [dict(workdir=w, run=w, method=m, label=m.upper(), images_per_s=ips)
            for w, m, ips in (("a", "x", 100.0), ("b", "x", 300.0), ("c", "y", None))]
    scalars = {"a": series([10, 15, 20], [0.2, 0.3, 0.6]), "b": series([10, 20], [0.4, 0.8]),
               "c": series([10, 20], [0.7, 0.9])}
    conv = convergence.analyze(rows, scalars, "y", 0.5)  # threshold 0.45
    x, y = conv.methods
    np.testing.assert_array_equal(x.steps, [10, 20])
    np.testing.assert_allclose(x.mean, [0.3, 0.7])
    np.testing.assert_allclose(x.low, [0.2, 0.6])
    np.testing.assert_allclose(x.high, [0.4, 0.8])
    assert x.reach == [20, 20] and y.reach == [10] and x.images_per_s == 200.0
    assert conv.threshold == pytest.approx(0.45)
    assert f"| X | 2 | {_top1(0.6, 0.8)} | 20 | 200 |" in convergence.markdown(conv)
    assert "| X | 2 | 70.0% (n=2) | 60.0-80.0% |" in convergence.markdown(conv)  # 0.1 points


def test_a_run_on_other_data_than_the_reference_is_left_out_with_the_reason():
    """A DTN run on CIFAR-10 got 'steps to 95% of LN's final' with LN trained on digits, and
    nothing said the two accuracies were on different data."""
    def series(steps, values):
        steps = np.asarray(steps)
        return {"eval/top1": Series(steps, np.asarray(values, np.float64), steps * 1.0, steps * 1.0)}
    digits, cifar = "digits 8px, 10 classes", "cifar10 32px, 10 classes"
    rows = [dict(workdir=w, run=w, method=m, label=m.upper(), images_per_s=None, data=d)
            for w, m, d in (("ln", "layernorm", digits), ("dtn", "dtn", digits),
                            ("dtn_c10", "dtn", cifar))]
    scalars = {"ln": series([10, 20], [0.5, 0.8]), "dtn": series([10, 20], [0.7, 0.9]),
               "dtn_c10": series([10, 20, 30], [0.3, 0.4, 0.45])}  # longer: not "still training"
    conv = convergence.analyze(rows, scalars, "layernorm", 0.5)
    assert conv.left_out == [("dtn_c10", f"trained on {cifar}, the reference LAYERNORM on {digits}")]
    assert [c.workdirs for c in conv.methods] == [["ln"], ["dtn"]]
    assert [c.reach for c in conv.methods] == [[10], [10]]  # threshold 0.4


def test_convergence_figure_legend_hides_no_curve():
    """The legend sat inside the axes at the lower right, over the curve of a method that
    stays low (a diverging RepBN run at 19% was hidden under it); outside, it must not cover the
    title either."""
    from normvit_jax.analysis import plots_convergence  # pylint: disable=import-outside-toplevel
    steps = np.arange(10, 70, 10)
    rows = [dict(workdir=w, run=w, method=m, label=m, images_per_s=None)
            for w, m in (("a", "layernorm"), ("b", "repbn"), ("c", "dtn"))]
    curves = {"a": [0.3, 0.5, 0.6, 0.65, 0.7, 0.73], "b": [0.2, 0.19, 0.18, 0.19, 0.2, 0.19],
              "c": [0.25, 0.45, 0.55, 0.6, 0.7, 0.78]}
    scalars = {w: {"eval/top1": Series(steps, np.asarray(v), steps * 1.0, steps * 1.0)}
               for w, v in curves.items()}
    fig = plots_convergence.convergence_figure(
        convergence.analyze(rows, scalars, "layernorm"),
        "Eval top-1 against steps, mean over each method's runs: ViT-custom (d4 w64 h4 p2, 8px "
        "digits)")
    fig.canvas.draw()
    ax, = fig.axes
    box = (fig.legends or [ax.get_legend()])[0].get_window_extent()
    for line in ax.get_lines():
        for x, y in ax.transData.transform(line.get_xydata()):
            assert not box.contains(x, y), (line.get_label(), x, y, box)
    titles = [t for t in (ax.title, fig._suptitle) if t is not None and t.get_text()]  # pylint: disable=protected-access
    assert titles and not any(t.get_window_extent().overlaps(box) for t in titles)


def test_progressive_runs_are_keyed_and_named_by_their_two_norms():
    for cfg, key, name in ((vit_progressive.get_config("demo"), "progressive:layernorm->repbn",
                            "LN->RepBN"),
                           (vit_dynamic_feature.get_config("demo"), "progressive:zscore->repbn",
                            "zscore->RepBN"),
                           (vit_dynamic_feature.get_config("demo,minmax"),
                            "progressive:minmax->repbn", "minmax->RepBN")):
        assert colors.method_of(cfg) == key and colors.label(key) == name
    assert colors.method_of({"model": {"norm": {"name": "progressive"}}}) == \
        "progressive:layernorm->repbn"  # the module's default N1, N2
    assert colors.label("progressive:dyt->batchnorm") == "DyT->BN"
    new = ["repbn", "zscore", "minmax", "dyt", "derf", "progressive:layernorm->repbn"]
    assert all(colors.color(m) == colors.METHODS[m][1] for m in new)


def test_report_without_the_runs_prepared_dataset_takes_classes_from_the_checkpoint(
        fake_runs, tmp_path, capsys):
    run = tmp_path / "moved"  # a run whose prepared data_dir is not on this machine
    shutil.copytree(fake_runs / "ln_s0", run)
    cfg = json.loads((run / "config.json").read_text())
    cfg["data"].update(name="fmnist", data_dir=str(tmp_path / "gone"))
    (run / "config.json").write_text(json.dumps(cfg))
    assert report.main([str(run), f"--out={tmp_path}/r", "--no_attention"]) == 0
    assert f"report: {run}: dataset 'fmnist' not readable here" in capsys.readouterr().err
    row, = json.load(open(tmp_path / "r" / "report.json"))
    assert row["model"].endswith("8px fmnist)") and row["flops_per_image"] > 0
    assert row["data"] == "fmnist 8px, 10 classes"  # what convergence compares with the reference
    assert row["analytic_flops_per_image"] > 0 and row["final_top1"] == 0.875


# Two learning rates x two seeds of LN, one LN run with another batch size, one DyT run. ln_a1
# also differs in keys that change neither what is trained nor how it is evaluated: it pools.
RECIPES = {
    "ln_a0": ("layernorm", [0.25, 0.625, 0.75, 0.875], {"optimizer.learning_rate": 0.001}),
    "ln_a1": ("layernorm", [0.5, 0.75, 0.875, 0.75],
              {"optimizer.learning_rate": 0.001, "seed": 1, "log_every": 7, "checkpoint_every": 5,
               "keep_checkpoints": 1, "reproducible_cpu_threads": 1}),
    "ln_b0": ("layernorm", [0.125, 0.25, 0.5, 0.75], {"optimizer.learning_rate": 0.003}),
    "ln_b1": ("layernorm", [0.25, 0.5, 0.625, 0.625],
              {"optimizer.learning_rate": 0.003, "seed": 1}),
    "ln_c": ("layernorm", [0.5, 0.5, 0.5, 0.5],
             {"optimizer.learning_rate": 0.001, "batch_size": 16}),
    "dyt": ("dyt", [0.25, 0.5, 0.75, 1.0], {"optimizer.learning_rate": 0.001}),
}
LN_A = "layernorm[batch_size=32,optimizer.learning_rate=0.001]"
LN_B = "layernorm[batch_size=32,optimizer.learning_rate=0.003]"
LN_C = "layernorm[batch_size=16,optimizer.learning_rate=0.001]"


@pytest.fixture(scope="module")
def recipe_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("recipes")
    for name, (norm, values, overrides) in RECIPES.items():
        _fake_run(str(root / name), norm, [10, 20, 30, 40], values, **overrides)
    return [str(root / n) for n in RECIPES]


def test_runs_of_one_norm_with_other_recipes_are_separate_methods(recipe_runs, tmp_path, capsys):
    """8 LN/RMS demo runs at two learning rates x two seeds were pooled as 4 seeds of LN (and an
    LN run with another batch size or depth with them); nothing said what differed."""
    out = tmp_path / "rep"
    assert report.main([*recipe_runs, f"--out={out}", "--no_attention", "--target=0.9",
                        f"--reference={LN_A}"]) == 0
    captured = capsys.readouterr()
    rows = {r["run"]: r for r in json.load(open(out / "report.json"))}
    assert {k: r["method"] for k, r in rows.items()} == {
        "ln_a0": LN_A, "ln_a1": LN_A, "ln_b0": LN_B, "ln_b1": LN_B, "ln_c": LN_C, "dyt": "dyt"}
    assert rows["ln_b1"]["recipe"] == {"batch_size": 32, "optimizer.learning_rate": 0.003}
    assert rows["dyt"]["recipe"] == {} and rows["dyt"]["label"] == "DyT"
    assert rows["ln_a0"]["label"] == "LN [batch_size=32, lr=0.001]"
    # threshold 0.9 x LN_A's mean final (0.875 + 0.75) / 2 = 0.73125
    md = (out / "report.md").read_text()
    for row in (f"| LN [batch_size=32, lr=0.001] | 2 | {_top1(0.875, 0.75)} | 25 (30, 20) | – |",
                f"| LN [batch_size=32, lr=0.003] | 2 | {_top1(0.75, 0.625)} | "
                "not all runs (40, never) | – |",
                f"| LN [batch_size=16, lr=0.001] | 1 | {_top1(0.5)} | "
                "never (1 run) | – |",
                f"| DyT | 1 | {_top1(1.0)} | 30 | – |"):
        assert row in md and row in captured.out, row
    assert "steps to 90% of LN [batch_size=32, lr=0.001]'s final (73.1%; evals every 10 steps)" in md
    assert ("- Config keys that differ between the runs: between methods: model.norm.name; "
            "recipes of one method (separate rows): batch_size, optimizer.learning_rate; "
            "seeds (pooled): seed; not compared (they change neither what is trained nor how it "
            "is evaluated): checkpoint_every, keep_checkpoints, log_every, "
            "reproducible_cpu_threads.\n") in md
    assert rows["ln_a1"]["convergence"]["steps_to_target"] == 20


def test_the_reference_among_several_recipes_of_a_norm(recipe_runs, tmp_path, capsys):
    """--reference=layernorm (or its default) with three LN recipes: which one's final top-1?"""
    out = tmp_path / "r"
    assert report.main([*recipe_runs, f"--out={out}", "--no_attention",
                        "--reference=layernorm"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: --reference='layernorm' is 3 methods of these runs (recipes of "
                   f"layernorm); pass one of their keys: {LN_A}, {LN_B}, {LN_C}"], err
    assert not out.exists()
    assert report.main([*recipe_runs, f"--out={out}", "--no_attention"]) == 0
    why = (f"no --reference, and the layernorm runs are 3 methods; pass one of their keys: "
           f"--reference={LN_A}, --reference={LN_B}, --reference={LN_C}")
    assert f"report: no convergence table: {why}" in capsys.readouterr().err
    assert f"Not computed: {why}.\n" in (out / "report.md").read_text()


def test_each_method_of_a_report_gets_its_own_colour():
    keys = [LN_A, LN_B, LN_C, "dyt", "layernorm"]
    pal = colors.palette(keys)
    assert len(set(pal.values())) == len(keys)
    assert pal[LN_A] == colors.color("layernorm") and pal["dyt"] == colors.color("dyt")
    # the other recipes take no colour another method of colors.METHODS stands for
    assert not {pal[LN_B], pal[LN_C]} & {c for _, c in colors.METHODS.values()}
    assert colors.label("layernorm+post[model.depth=2]") == "LN (+post-norm) [depth=2]"
    assert colors.label("dyt[data.name=cifar10,optimizer.name=sgd]") == \
        "DyT [data.name=cifar10, optimizer.name=sgd]"


def test_the_recipe_rule_reads_every_key_but_seeds_and_bookkeeping():
    from normvit_jax.analysis import recipes  # pylint: disable=import-outside-toplevel
    from normvit_jax import run_config  # pylint: disable=import-outside-toplevel
    base = run_config.flat_values(tiny_demo_config())
    for key in ("optimizer.learning_rate", "batch_size", "model.depth", "total_steps",
                "eval_every", "data.eval_split", "dtype", "grad_accum_steps", "init_from",
                "model.norm.epsilon", "model.norm_overrides.final.name"):
        assert recipes.compared(key), key
    for key in ("seed", "log_every", "checkpoint_every", "keep_checkpoints", "mesh.fsdp",
                "data.data_dir", "reproducible_cpu_threads", "allow_config_change",
                "data.prefetch", "model.attention_impl", "eval_batch_size",
                # how a norm computes the same values: eval may change them too (evaluation.py)
                "model.norm.saved_input", "model.norm.kernel",
                "model.norm_overrides.final.recompute"):
        assert not recipes.compared(key), key
    assert all(k in base for k in recipes.NOT_COMPARED), set(recipes.NOT_COMPARED) - set(base)


def test_finished_runs_of_other_lengths_are_kept_a_run_cut_short_is_not(tmp_path, capsys):
    """200-step runs and one 400-step run: every 200-step run was left out as 'still training?'
    (its last evaluation before the 400-step run's), though each had reached its own end."""
    steps = [10, 20, 30, 40]
    for name, (norm, values) in CURVES.items():
        _fake_run(str(tmp_path / name), norm, steps, values)
    _fake_run(str(tmp_path / "dyt_long"), "dyt", steps + [50, 60, 70, 80],
              [0.25, 0.5, 0.625, 0.75, 0.75, 0.75, 0.8, 0.875], total_steps=80)
    _fake_run(str(tmp_path / "ln_cut"), "layernorm", [10, 20], [0.875, 1.0])  # of 40 steps
    runs = [str(tmp_path / n) for n in (*CURVES, "dyt_long", "ln_cut")]
    out = tmp_path / "rep"
    assert report.main([*runs, f"--out={out}", "--no_attention", "--target=0.9",
                        "--reference=layernorm"]) == 0
    err = capsys.readouterr().err
    assert err.count("leaving out") == 1 and (
        f"leaving out {tmp_path / 'ln_cut'}: still training? its last evaluation is at step 20, "
        "before its final step 40 (config.total_steps)") in err
    md = (out / "report.md").read_text()
    assert f"| LN | 2 | {_top1(0.875, 0.75)} | 25 (30, 20) |" in md  # threshold 0.73125, as above
    assert f"| DyT [total_steps=40] | 2 | {_top1(0.75, 0.625)} | not all runs (40, never) |" in md
    assert f"| DyT [total_steps=80] | 1 | {_top1(0.875)} | 40 |" in md


def test_a_runs_final_step_from_its_config_or_its_methods_runs():
    """total_steps, else num_epochs x the train split's steps per epoch; None when the dataset
    cannot be opened here (analyze then compares with its method's other runs)."""
    cfg = tiny_demo_config(total_steps=None, num_epochs=2.0)
    ds = data.resolve_data_spec(cfg)
    per_epoch = data.make_pipeline(cfg, "train", ds, process_index=0,
                                   process_count=1).steps_per_epoch
    assert report.final_step(cfg) == (2 * per_epoch, "config.num_epochs=2.0")
    assert report.final_step(tiny_demo_config(total_steps=7)) == (7, "config.total_steps")
    gone = tiny_demo_config(total_steps=None)
    gone.data.name, gone.data.data_dir = "fmnist", "/nonexistent"
    assert report.final_step(gone) == (None, None)

    def series(steps):
        steps = np.asarray(steps)
        return {"eval/top1": Series(steps, np.full(len(steps), 0.5), steps * 1.0, steps * 1.0)}
    rows = [dict(workdir=w, run=w, method=m, label=m, images_per_s=None, final_step=None,
                 final_step_from=None) for w, m in (("a", "x"), ("b", "x"), ("c", "y"))]
    conv = convergence.analyze(rows, {"a": series([10, 20]), "b": series([10]),
                                      "c": series([10, 20, 30])}, "x")
    assert conv.left_out == [("b", "still training? its last evaluation is at step 10, its "
                                   "method's other runs' at 20 (its final step is not known "
                                   "here)")]
    assert [c.workdirs for c in conv.methods] == [["a"], ["c"]]


def test_the_keys_line_groups_the_norm_options_of_many_methods():
    """Seventeen norms differ in ~50 model.norm.* options: the line names the group once with
    its count, keeps lone keys of a group and every other key as they are."""
    from normvit_jax.analysis import recipes
    r = recipes.Recipes(method={}, recipe={}, within=[], seeds=["seed"], ignored=[],
                        between=["model.final_norm", "model.norm.epsilon", "model.norm.momentum",
                                 "model.norm.name", "model.norm_overrides.final.name",
                                 "model.patch_norm"])
    assert r.line() == ("- Config keys that differ between the runs: between methods: "
                        "model.final_norm, model.norm.* (3 keys), model.norm_overrides.final.name, "
                        "model.patch_norm; seeds (pooled): seed.\n")
