"""Defects a researcher's walk through the report found: method keys with per-slot overrides,
markers on short series, triangle overlap, 'never' cells, integer step ticks, RepBN's BN scale,
--weights=ema without EMAs, wall-time units, title wrapping, the '*' footnote."""
from __future__ import annotations

import json

import numpy as np
import pytest

from normvit_jax.analysis import (colors, convergence, figures, gates, plots_attention,
                                  plots_convergence, plots_curves, report)
from normvit_jax.summaries import Series
from tests.conftest import tiny_demo_config
from tests.test_convergence import CURVES, _fake_run


def _model(**kw):
    cfg = tiny_demo_config()
    for k, v in kw.items():
        setattr(cfg.model, k, v)
    return cfg


def test_a_block_range_override_is_labelled_with_the_blocks_it_covers():
    """'blocks_<a>_<b>' is end-exclusive (models/spec.py: a <= block < b): blocks_0_1 is block 0
    alone, but the plots' legend said "blocks 0-1"."""
    one = colors.method_of(_model(norm_overrides={"blocks_0_1": {"name": "rmsnorm"}}))
    assert one == "layernorm+blocks_0_1:rmsnorm" and colors.label(one) == "LN (+RMSNorm block 0)"
    three = colors.method_of(_model(norm_overrides={"blocks_2_5": {"name": "rmsnorm"}}))
    assert colors.label(three) == "LN (+RMSNorm blocks 2-4)"
    from normvit_jax.models import spec as model_spec
    norm, rms = {"name": "layernorm"}, {"name": "rmsnorm"}
    chosen = [model_spec._norm_for_slot(norm, (("blocks_2_5", rms),), b) for b in range(6)]
    assert [c["name"] for c in chosen] == ["layernorm"] * 2 + ["rmsnorm"] * 3 + ["layernorm"]


def test_method_key_tells_overrides_and_placement_apart_but_not_seeds():
    ln = colors.method_of(_model())
    rms1 = colors.method_of(_model(norm_overrides={"block_1": {"name": "rmsnorm"}}))
    post = colors.method_of(_model(norm_placement="post"))
    assert ln == "layernorm" and colors.method_of(_model(dropout_rate=0.1)) == ln
    assert rms1 == "layernorm+block_1:rmsnorm" and colors.label(rms1) == "LN (+RMSNorm block 1)"
    assert post == "layernorm+post" and len({ln, rms1, post}) == 3
    assert colors.method_of(_model(norm_overrides={"final": {"name": "layernorm"}})) == ln


def test_every_demo_method_is_its_plain_key_its_recipe_options_no_parts():
    """A method's own recipe (DTN's LN slots, RescaleViT's residual scaling without a final norm)
    is the method, not a variant: the demo report's rows read 'RescaleViT', not 'RescaleViT (+
    residual rescale, no final norm)'; a change away from the recipe still shows."""
    import importlib

    from benchmarks import demo_table
    for key, _, config_file in demo_table.METHODS:
        cfg = json.loads(importlib.import_module(f"configs.{config_file[:-3]}")
                         .get_config("demo").to_json_best_effort())
        assert "+" not in colors.method_of(cfg), (key, colors.method_of(cfg))
        if key == "rescale":
            cfg["model"]["final_norm"] = True
            assert colors.method_of(cfg) == "rescale+final_norm"


def test_report_does_not_pool_an_overridden_run_with_plain_ln(tmp_path):
    steps = [10, 20, 30, 40]
    _fake_run(str(tmp_path / "ln"), "layernorm", steps, CURVES["ln_s0"][1])
    _fake_run(str(tmp_path / "ln_rms"), "layernorm", steps, CURVES["dyt_s1"][1])
    cfg = json.loads((tmp_path / "ln_rms" / "config.json").read_text())
    cfg["model"]["norm_overrides"] = {"block_0": {"name": "rmsnorm"}}
    (tmp_path / "ln_rms" / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "out"
    report.write_report([str(tmp_path / "ln"), str(tmp_path / "ln_rms")], str(out),
                        no_attention=True)
    rows = json.loads((out / "report.json").read_text())
    assert [r["method"] for r in rows] == ["layernorm", "layernorm+block_0:rmsnorm"]
    assert rows[0]["size_of"] == "trained (unfolded) model" and rows[0]["folded_params"] is None
    md = (out / "report.md").read_text()
    assert "| LN | 1 |" in md and "| LN (+RMSNorm block 0) | 1 |" in md and "never (1 run)" in md


def _series(steps, values):
    steps = np.asarray(steps)
    return Series(steps, np.asarray(values, np.float64), steps * 30.0, steps * 30.0)


def test_single_point_series_get_markers_and_integer_step_ticks():
    runs = [("LN", colors.color("layernorm"), {"tok/x": _series([200], [1.0]),
                                              "eval/top1": _series([200], [0.5])})]
    fig = plots_curves.curves_figure(runs, "step", "t", [("tok/x", "x", "v", 1.0),
                                                         ("eval/top1", "top1", "%", 100.0)])
    for ax in fig.axes[:2]:
        assert ax.lines[0].get_marker() not in (None, "None", "")
        fig.canvas.draw()
        ticks = ax.get_xticks()
        assert np.allclose(ticks, np.round(ticks))
    assert plots_curves.needs_markers("train/loss", 1) and not plots_curves.needs_markers("train/loss", 50)


def test_train_loss_panel_names_label_smoothing():
    """train/loss is the label-smoothed objective (>= ~0.5 at 0.1), eval/loss plain CE: both were
    labelled 'cross-entropy'."""
    assert plots_curves.panels([0.0, 0.0]) == plots_curves.PANELS
    train, ev, _ = plots_curves.panels([0.1, 0.1])
    assert train[2] == "label-smoothed cross-entropy (ε=0.1)" and ev[2] == "cross-entropy (no smoothing)"
    assert plots_curves.panels([0.0, 0.1])[0][2] == "label-smoothed cross-entropy (ε=0/0.1)"
    runs = [("LN", colors.color("layernorm"), {"train/loss": _series([1, 2], [1.0, 0.5])})]
    fig = plots_curves.curves_figure(runs, "step", "t", plots_curves.panels([0.1]))
    assert fig.axes[0].get_ylabel() == "label-smoothed cross-entropy (ε=0.1)"


def test_wall_time_axis_unit_follows_the_range():
    assert plots_curves.time_unit(30)[0] == "seconds"
    assert plots_curves.time_unit(1800)[0] == "minutes"
    assert plots_curves.time_unit(5 * 3600)[0] == "hours"
    runs = [("LN", colors.color("layernorm"), {"train/loss": _series([1, 2], [1.0, 0.5])})]
    fig = plots_curves.curves_figure(runs, "elapsed", "t")
    assert "seconds" in fig.axes[0].get_xlabel()
    # the first event is written before compiling: the axis holds the compilation
    assert "compilation included" in fig.axes[0].get_xlabel()


def _curve(method, reach):
    one = np.array([0.9])
    return convergence.MethodCurve(method, colors.label(method), [method], one, [reach],
                                   np.array([200]), one, one, one, None)


def test_triangles_at_the_same_step_do_not_overlap_and_never_is_written():
    conv = convergence.Convergence("layernorm", "LN", 0.95, 0.85,
                                   [_curve("layernorm", 200), _curve("dyt", 200),
                                    _curve("repbn", None)], [])
    pos = plots_convergence.triangle_positions(conv)
    assert len(pos) == 2 and pos[0][1] == pos[1][1] and pos[0][2] != pos[1][2]
    assert convergence.reach_cell(conv.methods[2]) == "never (1 run)"
    fig = plots_convergence.convergence_figure(conv, "x" * 5 + " ViT-custom (d4 w64 h4 p2, 8px digits)")
    assert any("never (1 run)" in t.get_text() for t in fig.legends[0].get_texts())


def test_wrap_breaks_at_spaces_only():
    fig = figures.figure(3.0, 2.0)
    text = figures.wrap(fig, "Eval top-1 of ViT-custom LN->RepBN against steps " * 3, 10)
    assert all(w in ("top-1", "ViT-custom", "LN->RepBN") or "-" not in w for w in text.split())


def test_repbns_bn_scale_is_a_gate():
    variables = {"params": {"encoder_norm": {"eta": np.float32(0.5),
                                             "bn": {"scale": np.array([-2.0, 1.0]),
                                                    "bias": np.zeros(2)}}}}
    assert gates.norm_gates(variables)["encoder_norm"]["scale_abs_mean"] == pytest.approx(1.5)


def test_attention_map_footnote_explains_star_only_when_present():
    base, maps = [np.zeros((4, 4, 3))], [[np.ones((2, 2))]]
    plain = plots_attention.overlay_grid(base, maps, ["i"], ["block 0"], "t")
    star = plots_attention.overlay_grid(base, maps, ["i"], ["block 0*"], "t")
    assert "*" not in plain._supxlabel.get_text() and "*" in star._supxlabel.get_text()


def test_report_weights_ema_without_any_ema_is_one_line_exit_2(tmp_path, capsys):
    _fake_run(str(tmp_path / "ln"), "layernorm", [10, 20], [0.5, 0.6])
    rc = report.main([str(tmp_path / "ln"), f"--out={tmp_path / 'out'}", "--weights=ema"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1].startswith("error: --weights=ema: none of the runs")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("norm", ["repbn", "dyt"])
def test_folded_size_is_the_model_without_its_norms(norm):
    """The report's folded params of a RepBN/DyT model: what remains when every norm slot
    becomes the identity (its affine folded into the next Dense), counted on a model built with
    `identity` in every slot, independently of reparam (DyT: plus each slot's alpha)."""
    import jax
    import jax.numpy as jnp

    from normvit_jax import data, models
    cfg = tiny_demo_config()
    cfg.model.norm = {"name": norm}
    ds = data.resolve_data_spec(cfg)
    x = jnp.zeros((1, *ds.image_shape))
    variables = models.create(cfg, ds.num_classes).init(jax.random.PRNGKey(0), x, train=False)
    params, fl = report.folded_size(cfg, ds, variables)
    bare = tiny_demo_config()
    bare.model.norm = {"name": "identity"}
    expected = models.create(bare, ds.num_classes).init(jax.random.PRNGKey(0), x, train=False)
    n_trained = sum(np.size(v) for v in jax.tree.leaves(variables["params"]))
    # DyT's slots keep their scalar alpha (tanh(alpha * x) stays; its affine folds)
    kept = 2 * cfg.model.depth + 1 if norm == "dyt" else 0
    assert params == sum(np.size(v) for v in jax.tree.leaves(expected["params"])) + kept < n_trained
    assert fl is not None and fl > 0


def test_report_notes_a_run_whose_event_file_is_damaged(tmp_path, capsys):
    """A truncated event file read quietly up to the damage: the report showed the last eval
    before it as the run's final top-1 without a word. Now the run keeps its row and the report
    notes, on stderr and in report.md, the file and the step it was read up to."""
    import glob
    import os
    steps = [10, 20, 30, 40]
    _fake_run(str(tmp_path / "ln"), "layernorm", steps, CURVES["ln_s0"][1])
    _fake_run(str(tmp_path / "cut"), "layernorm", steps, CURVES["ln_s1"][1])
    (path,) = glob.glob(str(tmp_path / "cut" / "events.out.tfevents*"))
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2 + 7)
    out = tmp_path / "out"
    report.write_report([str(tmp_path / "ln"), str(tmp_path / "cut")], str(out),
                        no_attention=True)
    assert len(json.loads((out / "report.json").read_text())) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if path in line]
    assert len(err) == 1 and err[0].startswith(f"report: note {tmp_path / 'cut'}: ") \
        and "read up to step" in err[0], err
    md = (out / "report.md").read_text()
    assert f"- note {tmp_path / 'cut'}: the event file {path} is damaged" in md, md[-2000:]
