"""normvit_jax.analysis: attention distance, summaries reader, gates, CLI outputs, report, eval hook."""
from __future__ import annotations

import csv
import json
import math
import os
import shutil

import jax
import matplotlib.image
import numpy as np
import pytest
from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.summary.writer.record_writer import RecordWriter
from tensorboard.util import tensor_util

from normvit_jax import models, summaries
from normvit_jax.models import scan_convert
from normvit_jax.analysis import (attention, capture, colors, distance, flops, gates, eval_hook,
                                  report)
from tests.conftest import tiny_demo_config


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2-block, 2-head LN ViT on 8x8 digits (patch 2: a 4x4 grid) trained for 4 steps, with
    the eval-time analysis of 4 images (one attention-map image) at steps 2 and 4."""
    from normvit_jax.train import loop
    workdir = str(tmp_path_factory.mktemp("run") / "ln")
    cfg = tiny_demo_config(total_steps=4, eval_every=2, log_every=1, checkpoint_every=4,
                           eval_analysis_images=4, eval_attention_images=1)
    out = loop.train_and_evaluate(cfg, workdir)
    return workdir, out


# ---- attention distance on hand-built matrices ----

def test_distance_self_attention_is_zero_and_opposite_corner_is_diagonal():
    grid, p = (2, 2), 4  # patch centres 4 px apart
    eye = np.eye(5, dtype=np.float32)[None, None]  # class token + 4 patches
    assert float(distance.mean_attention_distance(eye, grid, p)[0, 0]) == 0.0
    # Half the mass on the class token, half on the query itself: the class token is left out.
    half = 0.5 * (eye + np.eye(5, dtype=np.float32)[0][None, None, None, :])
    assert float(distance.mean_attention_distance(half, grid, p)[0, 0]) == 0.0
    # Every patch attends to the diagonally opposite one (row-major 0<->3, 1<->2): 4*sqrt(2) px.
    opp = np.zeros((1, 1, 4, 4), np.float32)
    opp[0, 0, [0, 1, 2, 3], [3, 2, 1, 0]] = 1.0
    np.testing.assert_allclose(distance.mean_attention_distance(opp, grid, p), [[4 * math.sqrt(2)]],
                               rtol=1e-6)


def test_distance_uniform_is_the_grid_mean_distance():
    # 2x2 grid, patch 4: from any patch the distances are 0, 4, 4, 4*sqrt(2).
    uni = np.full((1, 2, 5, 5), 0.2, np.float32)
    np.testing.assert_allclose(distance.mean_attention_distance(uni, (2, 2), 4),
                               np.full((1, 2), 2 + math.sqrt(2)), rtol=1e-6)
    # 3x3 grid, patch 1: the 81 ordered pairs are 9 at 0, 24 at 1, 16 at sqrt2, 12 at 2,
    # 16 at sqrt5, 4 at sqrt8.
    expected = (24 + 16 * math.sqrt(2) + 12 * 2 + 16 * math.sqrt(5) + 4 * math.sqrt(8)) / 81
    assert distance.uniform_distance((3, 3), 1) == pytest.approx(expected, rel=1e-12)
    np.testing.assert_allclose(distance.mean_attention_distance(np.full((1, 1, 9, 9), 1 / 9), (3, 3), 1),
                               [[expected]], rtol=1e-6)


# ---- summaries reader ----

SCALAR_METADATA = summary_pb2.SummaryMetadata(
    plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars"))  # as tf.summary.scalar


def _write_events(path, wall0, points):
    """A TFRecord event file with a file_version event at wall0 then (tag, step, wall, value)."""
    with open(path, "wb") as f:
        w = RecordWriter(f)
        w.write(event_pb2.Event(wall_time=wall0, file_version="brain.Event:2").SerializeToString())
        for tag, step, wall, value in points:
            v = summary_pb2.Summary.Value(tag=tag, tensor=tensor_util.make_tensor_proto(np.float32(value)),
                                          metadata=SCALAR_METADATA)
            w.write(event_pb2.Event(wall_time=wall, step=step,
                                    summary=summary_pb2.Summary(value=[v])).SerializeToString())


# Two processes: the first logs steps 1-3 and is stopped; the second resumes and rewrites step 3.
FIRST = [("train/loss", 1, 110.0, 2.0), ("train/examples_per_sec", 1, 110.0, 10.0),
         ("train/loss", 2, 120.0, 1.5), ("train/examples_per_sec", 2, 120.0, 400.0),
         ("eval/top1", 2, 121.0, 0.50), ("eval/top5", 2, 121.0, 0.90), ("eval/loss", 2, 121.0, 1.6),
         ("train/loss", 3, 130.0, 1.4), ("train/examples_per_sec", 3, 130.0, 500.0)]
SECOND = [("train/loss", 3, 1010.0, 1.3), ("train/examples_per_sec", 3, 1010.0, 300.0),
          ("eval/top1", 4, 1020.0, 0.875), ("eval/top5", 4, 1020.0, 1.0), ("eval/loss", 4, 1020.0, 1.2),
          ("train/loss", 4, 1020.0, 1.1), ("train/examples_per_sec", 4, 1020.0, 450.0),
          ("eval/top1", 6, 1030.0, 0.625), ("eval/top5", 6, 1030.0, 0.96), ("eval/loss", 6, 1030.0, 1.4)]


def _write_run(workdir):
    _write_events(os.path.join(workdir, "events.out.tfevents.100.host.1.0.v2"), 100.0, FIRST)
    _write_events(os.path.join(workdir, "events.out.tfevents.1000.host.2.0.v2"), 1000.0, SECOND)


def test_read_run_last_write_wins_and_wall_time_skips_the_restart_gap(tmp_path):
    _write_run(str(tmp_path))
    run = summaries.read_run(str(tmp_path))
    loss = run.scalars["train/loss"]
    np.testing.assert_array_equal(loss.steps, [1, 2, 3, 4])
    np.testing.assert_allclose(loss.values, [2.0, 1.5, 1.3, 1.1], rtol=1e-6)  # step 3 from the resume
    assert run.wall_time_s == pytest.approx((130 - 100) + (1030 - 1000))
    # Step 4 was logged 20 s into the second process, after 30 s of the first.
    np.testing.assert_allclose(loss.elapsed, [10.0, 20.0, 30.0 + 10.0, 30.0 + 20.0])
    np.testing.assert_allclose(run.scalars["eval/top1"].values, [0.5, 0.875, 0.625])



def test_images_per_s_leaves_out_each_restarts_compile_interval(tmp_path):
    """After a resume the restart's first log interval (its compilation: 60 images/s here) was
    kept in the median; only the very first interval of the run was left out."""
    ips = "train/examples_per_sec"
    first = [(summaries.SEGMENT_TAG, 0, 100.0, 0.0), (ips, 10, 110.0, 50.0), (ips, 20, 120.0, 1000.0),
             (ips, 30, 130.0, 1100.0), (ips, 40, 140.0, 900.0)]
    second = [(summaries.SEGMENT_TAG, 40, 1000.0, 40.0), (ips, 50, 1010.0, 60.0),
              (ips, 60, 1020.0, 1050.0), (ips, 70, 1030.0, 950.0)]
    _write_events(os.path.join(tmp_path, "events.out.tfevents.100.host.1.0.v2"), 100.0, first)
    _write_events(os.path.join(tmp_path, "events.out.tfevents.1000.host.2.0.v2"), 1000.0, second)
    run = summaries.read_run(str(tmp_path))
    assert run.start_steps == [0, 40]
    kept = report.steady_throughput(run.scalars[ips], run.start_steps)
    np.testing.assert_allclose(kept, [1000.0, 1100.0, 900.0, 1050.0, 950.0])
    # a run written before the start marker: only its first interval is known to compile
    np.testing.assert_allclose(report.steady_throughput(run.scalars[ips], []),
                               [1000.0, 1100.0, 900.0, 60.0, 1050.0, 950.0])

# ---- gates ----

def test_gates_of_hand_built_variables():
    variables = {
        "params": {"Transformer": {
            "encoderblock_0": {"LayerNorm_0": {"var_gate": np.array([0.0, math.log(3.0)]),
                                               "mean_gate": np.array([-math.log(3.0), 0.0]),
                                               "scale": np.array([-2.0, 2.0, 1.0, -1.0])},
                               "MlpBlock_3": {"Dense_0": {"kernel": np.ones((2, 2))}},
                               "rescale_s": np.array(0.75)},
            "encoder_norm": {"g": np.array(5.0)}}},
        "batch_stats": {"Transformer": {"encoderblock_0": {"LayerNorm_0": {
            "skips": np.array(3.0), "t": np.array(12.0)}}}},
    }
    g = gates.norm_gates(variables)
    assert set(g) == {"encoderblock_0/LayerNorm_0", "encoderblock_0", "encoder_norm"}
    slot = g["encoderblock_0/LayerNorm_0"]
    assert slot["lambda_var_h0"] == pytest.approx(0.5) and slot["lambda_var_h1"] == pytest.approx(0.75)
    assert slot["lambda_mean_h0"] == pytest.approx(0.25) and slot["lambda_mean_h1"] == pytest.approx(0.5)
    assert slot["scale_abs_mean"] == pytest.approx(1.5)
    assert slot["skip_rate"] == pytest.approx(0.25)
    assert g["encoderblock_0"] == {"rescale_s": 0.75}
    assert g["encoder_norm"] == {"g_abs_mean": 5.0}


@pytest.mark.parametrize("norm,names", [("dyt", ["alpha"]), ("derf", ["alpha", "shift"]),
                                        ("repbn", ["eta"])])
def test_gates_report_the_pointwise_norms_alpha_and_repbns_eta(norm, names):
    """DyT's/DeRF's learned scalars (alpha, DeRF's shift) and RepBN's eta, per slot, as the
    model holds them (set here to random values: not their inits)."""
    model = models.create({"variant": "Ti/4", "depth": 2, "hidden_size": 16, "num_heads": 2,
                           "mlp_dim": 32, "norm": {"name": norm}}, 4)
    variables = jax.tree.map(np.asarray, model.init(jax.random.key(0), np.zeros((1, 8, 8, 3),
                                                                                np.float32)))
    rng, want = np.random.default_rng(7), {}

    def randomise(tree, path):
        for k, v in tree.items():
            if isinstance(v, dict):
                randomise(v, path + (k,))
            elif k in names:
                tree[k] = np.float32(rng.uniform(-2.0, 2.0))
                want["/".join(p for p in path if p != "Transformer") + "/" + k] = float(tree[k])
    randomise(variables["params"], ())
    got = {k: v for k, v in gates.flat(gates.norm_gates(variables)).items()
           if k.rsplit("/", 1)[1] in names}
    assert len(want) == 5 * len(names) and got == pytest.approx(want, rel=0, abs=0)


def test_scanned_encoder_is_analysed_per_block():
    stacked = {"Transformer": {"encoderblock": {"LayerNorm_0": {"var_gate": np.array([[0.0], [1.0]])},
                                                "rescale_s": np.array([1.0, 2.0])},
                               "encoderblock_2": {"rescale_s": np.array(3.0)}}}
    flat = scan_convert.unstack_blocks(stacked)["Transformer"]
    assert sorted(flat) == ["encoderblock_0", "encoderblock_1", "encoderblock_2"]
    assert flat["encoderblock_1"]["rescale_s"] == 2.0
    np.testing.assert_array_equal(flat["encoderblock_1"]["LayerNorm_0"]["var_gate"], [1.0])
    cfg = tiny_demo_config(**{"model.scan": True})
    model = models.create(cfg.model, 10)
    shapes = jax.eval_shape(model.init, jax.random.key(0), np.zeros((1, 8, 8, 3), np.float32))
    variables = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes)  # layout only
    assert "encoderblock" in variables["params"]["Transformer"]
    out = capture.make_analyzer(model, (4, 4), 2, full=True)(variables, np.zeros((2, 8, 8, 3), np.float32))
    assert [a.shape for a in out["attention"]] == [(2, 2, 17, 17)] * 2
    assert sorted(out["stats"]) == sorted(gates.norm_gates(variables)) == [
        "encoder_norm", "encoderblock_0/LayerNorm_0", "encoderblock_0/LayerNorm_2",
        "encoderblock_1/LayerNorm_0", "encoderblock_1/LayerNorm_2"]


def test_every_method_has_its_own_colour():
    cols = [colors.color(m) for m in colors.METHODS]
    assert len(set(cols)) == len(cols)
    assert colors.color("dtn") == colors.METHODS["dtn"][1]
    assert colors.method_of({"model": {"norm": {"name": "layernorm"}, "patch_norm": "dual"}}) == "dpn"


def test_analytic_flops_of_the_tiny_model(trained):
    cfg = tiny_demo_config()
    # 16 patches + class token (T=17), D=32, MLP 64, patch 2x2x3, 2 blocks, 10 classes.
    per_block = 4 * 17 * 32 * 32 + 2 * 17 * 17 * 32 + 2 * 17 * 32 * 64
    macs = 16 * 12 * 32 + 2 * per_block + 32 * 10
    assert flops.analytic_flops(models.spec_of(cfg, 10), 8) == 2 * macs
    run = capture.load_run(trained[0])
    xla = flops.xla_flops(run.model, run.variables, 8)  # counts norms, softmax, GELU on top
    assert 2 * macs <= xla <= 1.6 * 2 * macs


# ---- on the trained run ----

def test_capture_attention_rows_sum_to_one_and_shapes(trained):
    run = capture.load_run(trained[0])
    images, _ = capture.eval_images(run.config, run.data, 4)
    a = capture.analyze(run, images, full=True)
    assert len(a.attention) == 2 and a.has_cls == [True, True]
    for att in a.attention:
        assert att.shape == (4, 2, 17, 17)
        np.testing.assert_allclose(att.sum(-1), 1.0, atol=1e-5)
    assert a.distance.shape == (2, 4, 2)
    assert np.all((a.distance >= 0) & (a.distance <= 6 * math.sqrt(2) + 1e-4))  # corner to corner
    np.testing.assert_allclose(a.distance, distance.mean_attention_distance(
        np.stack(a.attention), (4, 4), 2), rtol=1e-5)
    np.testing.assert_allclose(a.cls_maps[1][:, :, 0, 0], a.attention[1][:, :, 0, 1], rtol=1e-6)
    assert set(a.stats) == {"encoderblock_0/LayerNorm_0", "encoderblock_0/LayerNorm_2",
                            "encoderblock_1/LayerNorm_0", "encoderblock_1/LayerNorm_2", "encoder_norm"}
    # LayerNorm output (scale ~1, bias ~0 after 4 steps): unit variance across channels.
    assert a.stats["encoder_norm"]["out"]["chan_var"] == pytest.approx(1.0, abs=0.05)


def test_attention_cli_writes_a_png_per_head_and_block_and_the_csvs(trained, tmp_path):
    out = str(tmp_path / "att")
    assert attention.main([f"--workdir={trained[0]}", "--images=4", "--stat_images=4",
                           f"--out={out}", "--heads=all", "--blocks=all"]) == 0
    names = set(os.listdir(out))
    assert {f"attention_maps_head{h}.png" for h in (0, 1)} <= names
    assert {f"attention_matrix_block{b}.png" for b in (0, 1)} <= names
    assert {"attention_distance.png", "token_stats.png", "norm_gates.png"} <= names
    img = matplotlib.image.imread(os.path.join(out, "attention_maps_head0.png"))
    assert img.ndim == 3 and img.shape[0] > 300  # 4 image rows
    with open(os.path.join(out, "attention_distance.csv")) as f:
        rows = list(csv.DictReader(f))
    assert sorted((int(r["block"]), int(r["head"])) for r in rows) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(int(r["images"]) == 4 for r in rows)
    with open(os.path.join(out, "token_stats.csv")) as f:
        assert len(list(csv.DictReader(f))) == 5 * 2  # 5 norm slots, before and after
    assert attention.default_blocks(12) == [0, 3, 6, 9]


def test_attention_and_report_name_a_bad_count_or_index_flag_in_one_line(trained, tmp_path, capsys):
    """--images=0 failed as 'zero-size array to reduction operation max' (report: skipped the
    analysis with that reason, exit 0), --heads=x as 'invalid literal for int()'."""
    base = [f"--workdir={trained[0]}", f"--out={tmp_path / 'att'}", "--images=2", "--stat_images=2"]
    for tool, argv, flag in ((attention, base + ["--images=0"], "--images: 0"),
                             (attention, base + ["--stat_images=-1"], "--stat_images: -1"),
                             (report, [trained[0], f"--out={tmp_path / 'rep'}", "--images=0"],
                              "--images: 0")):
        with pytest.raises(SystemExit) as e:
            tool.main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1, err
        assert f"error: argument {flag} is not accepted; accepted: an integer >= 1" in err, err
    for argv, line in ((["--heads=x"], "--heads=x: accepted 'auto', 'all' or a comma list in 0..1 "
                                       "(the model has 2 heads)"),
                       (["--blocks=5"], "--blocks=5: accepted 'auto', 'all' or a comma list in "
                                        "0..1 (the model has 2 blocks)")):
        assert attention.main(base + argv) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1] == (
            f"python -m normvit_jax.analysis.attention: error: {line}")
    assert not os.path.exists(tmp_path / "rep")


def test_attention_refuses_more_map_rows_than_its_maximum(trained, tmp_path, capsys):
    """--images=400 drew every image as a row of one PNG: 44,092 pixels tall, ten minutes."""
    out = tmp_path / "att"
    with pytest.raises(SystemExit) as e:
        attention.main([f"--workdir={trained[0]}", f"--out={out}", "--images=400"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert (f"error: argument --images: 400 is not accepted; accepted: an integer in "
            f"1..{attention.MAX_IMAGES} (each is a row of") in err, err
    assert not os.path.exists(out)
    assert attention.map_images(str(attention.MAX_IMAGES)) == attention.MAX_IMAGES


def test_report_names_a_tag_no_run_logged_before_writing(trained, tmp_path, capsys):
    """A misspelt --tags drew an empty panel in tags.png, exit 0, and nothing said so."""
    out = tmp_path / "rep"
    code = report.main([trained[0], f"--out={out}", "--no_attention",
                        "--tags=tokens/encoder_norm/in/max_ab"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1] == (
        "error: --tags: 'tokens/encoder_norm/in/max_ab' is logged by none of the runs; the "
        "closest: tokens/encoder_norm/in/max_abs, tokens/encoder_norm/out/max_abs, "
        "tokens/encoder_norm/in/chan_var"), err
    assert not os.path.exists(out / "report.md")
    assert report.main([trained[0], f"--out={out}", "--no_attention",
                        "--tags=tokens/encoder_norm/in/max_abs"]) == 0
    assert os.path.exists(out / "tags.png")


def test_report_table_equals_the_summaries(trained, tmp_path):
    workdir, out = trained
    fake = str(tmp_path / "resumed")  # the trained checkpoint with hand-written summaries
    shutil.copytree(os.path.join(workdir, "checkpoints"), os.path.join(fake, "checkpoints"))
    shutil.copy(os.path.join(workdir, "config.json"), fake)
    _write_run(fake)
    paths = report.write_report([workdir, fake], str(tmp_path / "rep"), images=4, stat_images=4)
    rows = {r["run"]: r for r in json.load(open(os.path.join(tmp_path, "rep", "report.json")))}
    r = rows["resumed"]
    assert r["best_top1"] == pytest.approx(0.875) and r["final_top1"] == pytest.approx(0.625)
    assert r["best_top5"] == pytest.approx(1.0) and r["final_top5"] == pytest.approx(0.96)
    assert r["steps"] == 6 and r["wall_time_s"] == pytest.approx(60.0)
    assert r["images_per_s"] == pytest.approx(np.median([400.0, 300.0, 450.0]))  # first left out
    real = rows["ln"]
    assert real["final_top1"] == pytest.approx(out["eval"]["top1"], rel=1e-6) and real["steps"] == 4
    n_params = sum(x.size for x in jax.tree.leaves(out["state"].params))
    assert r["params"] == real["params"] == n_params
    md = open(os.path.join(tmp_path, "rep", "report.md")).read()
    assert "| LN | resumed |" in md and "| 87.50% | 62.50% | 100.00% | 96.00% | 6 | 1m00s | 400 |" in md
    assert f"{n_params:,}" in md
    for name in ("curves_steps.png", "curves_wall.png", "attention_distance.png", "token_stats.png"):
        assert os.path.join(str(tmp_path / "rep"), name) in paths


def test_report_counts_a_run_given_twice_once(trained, tmp_path, capsys):
    """`report runs/ln runs/ln/` had two rows and made the run two seeds of LN (n=2 in the
    convergence table, its mean weighted twice)."""
    workdir = trained[0]
    out = tmp_path / "rep"
    report.write_report([workdir, workdir + os.sep, os.path.join(workdir, ".")], str(out),
                        no_attention=True)
    rows = json.load(open(out / "report.json"))
    assert [r["workdir"] for r in rows] == [workdir]
    assert open(out / "report.md").read().count("| LN | ln |") == 1
    err = capsys.readouterr().err
    assert err.count("is the same run as") == 2 and "counted once" in err


def test_runs_whose_folders_share_a_name_are_told_apart(trained, tmp_path):
    """`report a/ln b/ln` named both runs 'ln' in the table, report.json, the CSVs and the
    legends: nothing said which row was which run."""
    from normvit_jax.analysis import tables  # pylint: disable=import-outside-toplevel
    runs = [str(tmp_path / d / "ln") for d in ("a", "b")]
    for w in runs:
        shutil.copytree(trained[0], w)
    out = tmp_path / "rep"
    report.write_report(runs + [trained[0]], str(out), images=2, stat_images=2)
    rows = json.load(open(out / "report.json"))
    assert [r["run"] for r in rows][:2] == ["a/ln", "b/ln"]
    assert rows[2]["run"] not in ("a/ln", "b/ln", "ln")  # the fixture's own 'ln' collides too
    md = open(out / "report.md").read()
    assert "| LN | a/ln |" in md and "| LN | b/ln |" in md
    with open(out / "attention_distance.csv") as f:
        assert {r["run"] for r in csv.DictReader(f)} == {r["run"] for r in rows}
    # names that do not collide stay the base name; a longer suffix only where needed
    assert tables.run_names(["runs/ln", "runs/dtn/"]) == ["ln", "dtn"]
    assert tables.run_names(["x/s0/ln", "y/s0/ln", "x/s1/ln", "z/dtn"]) == [
        "x/s0/ln", "y/s0/ln", "x/s1/ln", "dtn"]
    assert tables.run_names(["/x/ln", "/y/x/ln"]) == ["/x/ln", "/y/x/ln"]  # whole: from the root


def test_a_long_run_name_leaves_the_panels_their_width():
    """A 90-character run name on one legend line took most of curves_steps.png: the three
    panels became slivers and the title ran off the canvas."""
    from normvit_jax.analysis import plots_curves  # pylint: disable=import-outside-toplevel
    rng = np.random.default_rng(0)
    steps = np.arange(10, 70, 10)
    series = lambda: summaries.Series(steps, rng.uniform(1, 2, len(steps)), steps * 1.0, steps * 1.0)
    long = "DTN (dtn_patch2_width64_depth4_heads4_lr1e-3_wd0.05_warmup100_seed0_cosine_run_long)"
    runs = [(lab, col, {t: series() for t in ("train/loss", "eval/loss", "eval/top1")})
            for lab, col in (("LN (ln)", "C0"), (long, "C2"))]
    fig = plots_curves.curves_figure(runs, "step", "Training curves per normalizer, against steps")
    fig.canvas.draw()
    width = fig.bbox.width
    panels = sum(ax.get_window_extent().width for ax in fig.axes)
    assert panels > 0.6 * width, (panels, width)
    texts = [t.get_text() for t in fig.legends[0].get_texts()]
    assert texts[1].replace("\n", "") == long  # wrapped, nothing cut
    assert max(len(line) for t in texts for line in t.split("\n")) <= 40
    for artist in (fig.legends[0], fig._suptitle):  # pylint: disable=protected-access
        box = artist.get_window_extent()
        assert box.x0 >= 0 and box.x1 <= width + 1, (artist, box, width)


def test_attention_on_a_folded_model_names_it(tmp_path, capsys):
    """`attention --workdir=<reparam --out folder>` said the folder held no run and to train one
    there (into the folded model's folder)."""
    folded = tmp_path / "folded"
    folded.mkdir()
    (folded / "model.json").write_text("{}")
    with pytest.raises(SystemExit) as e:  # cli.tool_errors exits with the table's code
        attention.main([f"--workdir={folded}", f"--out={tmp_path / 'a'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert "holds a folded model" in err[0] and "train one there" not in err[0], err


def test_runs_of_one_method_are_drawn_apart():
    """Two LN seeds were drawn in the same colour, line style and marker: the legend named each
    run, but nothing on the axes said which line was which."""
    from normvit_jax.analysis import plots_curves, plots_stats  # pylint: disable=import-outside-toplevel
    rng = np.random.default_rng(1)
    steps = np.arange(10, 50, 10)
    series = lambda: summaries.Series(steps, rng.uniform(1, 2, 4), steps * 1.0, steps * 1.0)
    runs = [(lab, colors.color(m), {t: series() for t in ("train/loss", "eval/loss", "eval/top1")})
            for lab, m in (("LN (s0)", "layernorm"), ("DTN (s0)", "dtn"), ("LN (s1)", "layernorm"))]
    stats = {"encoderblock_0/LayerNorm_0": {side: {k: float(rng.uniform(1, 2)) for k in
                                                   ("chan_mean", "chan_var", "tok_mean", "tok_var",
                                                    "max_abs")} for side in ("in", "out")}}
    figs = [plots_curves.curves_figure(runs, "step", "t"),
            plots_stats.token_stats_figure([(lab, col, stats) for lab, col, _ in runs], 1, "t")]
    for fig in figs:
        for ax in fig.axes:
            look = {ln.get_label(): (ln.get_linestyle(), ln.get_marker()) for ln in ax.get_lines()}
            if "LN (s0)" in look:
                assert look["LN (s0)"] != look["LN (s1)"], look
                assert look["LN (s0)"] == look["DTN (s0)"], look  # other colours keep the first


def test_live_eval_summaries(trained):
    run = capture.load_run(trained[0])
    images = eval_hook.fixed_images(run.config, run.data, 4)
    run.config.eval_attention_images = 2
    analyzer = eval_hook.EvalAnalyzer(run.model, run.config, run.data)
    scalars, pictures = analyzer(run.variables, images)
    a = capture.analyze(run, images, full=True)  # compiled by an earlier test for 4 images
    assert scalars["tokens/encoder_norm/in/max_abs"] == pytest.approx(a.stats["encoder_norm"]["in"]["max_abs"])
    assert len([k for k in scalars if k.startswith("tokens/")]) == 5 * 2 * 5
    assert scalars["attention_distance/encoderblock_1/head0"] == pytest.approx(a.distance[1, :, 0].mean())
    assert scalars["gates/encoder_norm/scale_abs_mean"] > 0
    maps = pictures["attention/maps"]
    assert maps.dtype == np.uint8 and maps.shape[0] == 2 and maps.shape[-1] == 3
    run.config.eval_attention_images = 0
    assert analyzer(run.variables, images)[1] == {}
    assert analyzer.forward._cache_size() == 1  # compiled once for the run


def test_training_writes_the_eval_analysis_to_tensorboard(trained):
    """The loop's evals at steps 2 and 4 wrote the token statistics, gates and attention
    distances of the first 4 eval images (equal to the hook run on the final state) and one
    attention-map image each."""
    workdir = trained[0]
    run = capture.load_run(workdir)
    run.config.eval_attention_images = 0
    expected, _ = eval_hook.EvalAnalyzer(run.model, run.config, run.data)(
        run.variables, eval_hook.fixed_images(run.config, run.data, 4))
    written = summaries.read_scalars(workdir)
    assert len(expected) > 50
    for tag, value in expected.items():
        assert [s for s, _, _ in written[tag]] == [2, 4], tag
        assert written[tag][-1][1] == pytest.approx(value, rel=1e-4, abs=1e-6), tag
    shapes = {}
    for path in summaries.event_files(workdir):
        for event in summaries.events(path):
            for v in event.summary.value:
                if v.tag.startswith("attention/maps"):
                    shapes[event.step] = v.tag
    assert sorted(shapes) == [2, 4]
