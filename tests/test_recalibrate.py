"""python -m normvit_jax.recalibrate: running statistics re-estimated at the final weights.

Reference: numpy float64 EMA (momentum 0.1, unbiased variance stored) of the batch statistics of
the first norm slot's input, computed from the model's own position-embedded tokens.
"""
from __future__ import annotations

import jax
import numpy as np
import pytest

from normvit_jax import checkpoints, data, models, recalibrate
from normvit_jax.data import stats as data_stats
from normvit_jax.train import loop, setup
from tests.conftest import tiny_demo_config

# Runs that compile the same programs again (a straight run, then stop + resume) load them from
# JAX's persistent compilation cache (tests/conftest.py: compile_cache) instead of compiling.
pytestmark = pytest.mark.usefixtures("compile_cache")


def first_slot_reference(run: str, variables: dict, batches: int) -> tuple[np.ndarray, np.ndarray]:
    """numpy float64 running average (momentum 0.1, unbiased variance) of block 0's first slot's
    statistics, from ``variables``' own, over the input of the first ``batches`` full eval
    batches of ``run`` (the position-embedded tokens, captured), under ``variables``."""
    view = recalibrate.statistics_view(checkpoints.load_config(run))
    model = models.create(view.model, 10)
    ds = setup.resolve_config(view, 1).data
    pipe = data.make_pipeline(view, "eval", ds)
    slot = variables["batch_stats"]["Transformer"]["encoderblock_0"]["LayerNorm_0"]["bn"]
    mean, var = (np.asarray(slot[k], np.float64) for k in ("mean", "var"))
    used = 0
    for batch in pipe.eval_batches():
        if used == batches:
            break
        if not batch["mask"].all():
            continue
        images = data_stats.model_input(batch["image"], ds.affine)
        _, inter = model.apply(variables, images, train=False, capture_intermediates=True,
                               mutable=["intermediates"])
        x = np.asarray(inter["intermediates"]["Transformer"]["posembed_input"]["__call__"][0],
                       np.float64).reshape(-1, mean.shape[0])
        mean = 0.9 * mean + 0.1 * x.mean(0)
        var = 0.9 * var + 0.1 * x.var(0, ddof=1)
        used += 1
    pipe.close()
    return mean, var


def test_recalibrates_the_statistics_and_writes_a_checkpoint(tmp_path, capsys):
    cfg = tiny_demo_config(total_steps=4, eval_every=100, checkpoint_every=100)
    cfg.model.norm = {"name": "repbn"}
    loop.train_and_evaluate(cfg, str(tmp_path / "run"))
    res = recalibrate.main([f"--workdir={tmp_path / 'run'}", f"--out={tmp_path / 'out'}",
                            "--batches=3"])
    captured = capsys.readouterr()
    assert "before: top-1" in captured.out and res["batches"] == 3
    assert "recalibrating" in captured.err and "/3 [" in captured.err, captured.err[-2000:]  # bar
    old, _ = checkpoints.load_variables(str(tmp_path / "run"))
    new, _ = checkpoints.load_variables(str(tmp_path / "out"))
    jax.tree.map(np.testing.assert_array_equal, old["params"], new["params"])

    # Independent reference for block 0's first slot: its input is the position-embedded tokens.
    slot = ("Transformer", "encoderblock_0", "LayerNorm_0", "bn")
    mean, var = first_slot_reference(str(tmp_path / "run"), old, 3)
    got = new["batch_stats"][slot[0]][slot[1]][slot[2]]["bn"]
    np.testing.assert_allclose(got["mean"], mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["var"], var, rtol=1e-5)
    assert not np.allclose(got["mean"], old["batch_stats"][slot[0]][slot[1]][slot[2]]["bn"]["mean"])
    # The written workdir is a run: the project's evaluation reads it.
    from normvit_jax import evaluation
    ev = evaluation.evaluate_checkpoint(checkpoints.load_config(str(tmp_path / "out")),
                                        str(tmp_path / "out"))
    assert ev["metrics"]["top1"] == pytest.approx(res["after"]["top1"])


def test_a_run_without_statistics_exits_2_with_one_line(tmp_path, capsys):
    cfg = tiny_demo_config(total_steps=2, eval_every=100, checkpoint_every=100)
    loop.train_and_evaluate(cfg, str(tmp_path / "run"))
    with pytest.raises(SystemExit) as e:
        recalibrate.main([f"--workdir={tmp_path / 'run'}", f"--out={tmp_path / 'out'}"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "keeps no running statistics" in err[0] and "'layernorm'" in err[0]
    assert err[0].startswith("python -m normvit_jax.recalibrate: error: ")  # docs/faults.md


def test_an_out_that_is_a_file_exits_2_with_one_line(tmp_path, capsys):
    """--out naming an existing file was listed as a folder before it was checked: a
    NotADirectoryError traceback and exit 1. The check runs before the run is read."""
    afile = tmp_path / "notes.txt"
    afile.write_text("mine")
    with pytest.raises(SystemExit) as e:
        recalibrate.main([f"--workdir={tmp_path / 'no_run'}", f"--out={afile}"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"python -m normvit_jax.recalibrate: error: --out={afile} exists and is not a "
                   "folder; pass the path of a folder"], err
    assert afile.read_text() == "mine"


@pytest.mark.parametrize("norm", ["powernorm", "unified"])
def test_the_norms_step_counters_keep_the_checkpoints_step(norm):
    """Each statistics forward advanced PowerNorm's and UN's step counter ``t`` (it drives their
    warmups and UN's gz window): a step-4 checkpoint recalibrated over 3 batches counted 7 steps.
    The re-estimated statistics change; the counters stay."""
    import jax.numpy as jnp
    from flax import traverse_util
    cfg = tiny_demo_config()
    cfg.model.norm = {"name": norm}
    model = models.create(recalibrate.statistics_view(cfg).model, 10)  # dropout off, as the tool
    images = jax.random.uniform(jax.random.key(0), (3, 8, 8, 8, 3))
    variables = model.init(jax.random.key(1), images[0], train=False)
    # the counters as a trained checkpoint has them (4 steps), not at their init value 0
    stats = jax.tree_util.tree_map_with_path(
        lambda p, v: jnp.full_like(v, 4.0) if p[-1].key == "t" else v, variables["batch_stats"])
    variables = {"params": variables["params"], "batch_stats": stats}
    batches = [{"image": x, "mask": np.ones(8, bool)} for x in images]
    new, used = recalibrate.recalibrate_stats(model, variables, batches, jnp.asarray(4), None, 3)
    assert used == 3
    old_flat = traverse_util.flatten_dict(stats, sep="/")
    new_flat = traverse_util.flatten_dict(new, sep="/")
    assert sorted(old_flat) == sorted(new_flat)
    counters = [k for k in old_flat if k.endswith("/t")]
    assert counters and all(float(new_flat[k]) == 4.0 for k in counters)
    running = [k for k in old_flat if k.endswith(("/running_phi", "/running_var"))]
    assert running and all(not np.allclose(new_flat[k], old_flat[k]) for k in running)
