"""``--weights=raw|ema`` of the tools that read a training workdir (checkpoints.choose_weights,
timm's --use-ema): with a run's weight EMA (RepBN: its averaged running statistics matter), predict,
export (npz and an artifact, folded too) and reparam give what a model built from the EMA arrays
of the checkpoint gives, read here from the restored tree by path, not through the tools' code;
the default stays the raw weights with one log line naming the flag; a run without an EMA, or
--weights beside a --folded folder, is one line, exit 2; what they write records the weights."""
from __future__ import annotations

import json
import logging

import numpy as np
import pytest
from flax import traverse_util

from normvit_jax import checkpoints, export, models, predict, reparam, run_data
from normvit_jax.data import stats, tf_images
from tests.conftest import tiny_demo_config
from tests.deploy_runs import write_images

pytestmark = pytest.mark.usefixtures("compile_cache")


def _train(workdir: str, **overrides) -> str:
    from normvit_jax.train import loop
    # one block: what the tools read (the EMA's weights and statistics) is the same at any depth
    c = tiny_demo_config(total_steps=3, eval_every=3, checkpoint_every=3, log_every=3,
                         **{"model.depth": 1, **overrides})
    c.optimizer.learning_rate = 1e-2  # the raw weights move away from their average
    loop.train_and_evaluate(c, workdir)
    return workdir


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> str:
    """RepBN with a weight EMA of decay 0.5 (three steps leave it far from the raw weights)."""
    return _train(str(tmp_path_factory.mktemp("ema_run")), ema_decay=0.5,
                  **{"model.norm": {"name": "repbn"}})


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> list[str]:
    return write_images(str(tmp_path_factory.mktemp("digits")), n=6)


def _by_path(state: dict, part: str) -> dict:
    """The subtree under the first key ``part`` anywhere in the restored state (the EMA lives at
    opt_state/<index>/ema_params)."""
    def walk(t):
        items = t.items() if isinstance(t, dict) else enumerate(t) if isinstance(t, (list, tuple)) else ()
        for k, v in items:
            if k == part:
                return v
            found = walk(v)
            if found is not None:
                return found
        return None
    return walk(state)


def _decoded(workdir: str, paths: list[str]) -> np.ndarray:
    """The uint8 eval images as predict reads them (what an artifact takes)."""
    config = checkpoints.load_config(workdir)
    _, x, bad = predict._decode(paths, predict.eval_geometry(config.data), tf_images.BatchDecoder(1))
    assert not bad
    return x


_APPLY: dict = {}


def _reference(workdir: str, paths: list[str], variables: dict) -> np.ndarray:
    """Softmax of the run's model with ``variables`` on the images as predict reads them (the
    model's forward jitted, one compile per model config, instead of op by op)."""
    import jax
    config = checkpoints.load_config(workdir)
    x = _decoded(workdir, paths)
    key = config.model.to_json(sort_keys=True)
    if key not in _APPLY:
        model = models.create(config.model, 10)
        _APPLY[key] = jax.jit(lambda v, inputs: model.apply(v, inputs, train=False))
    logits = _APPLY[key](variables, stats.model_input(x, run_data.affine(workdir, config)))
    return np.asarray(jax.nn.softmax(logits.astype(np.float32), -1))


def _probs(rows: list[dict]) -> np.ndarray:
    return np.array([[dict(r["top"])[str(c)] for c in range(10)] for r in rows])


_STATES: dict = {}


def _arrays(workdir: str) -> tuple[dict, dict]:
    if workdir not in _STATES:  # restored once per workdir (read only here)
        _STATES[workdir] = checkpoints.load_state(workdir)[0]
    state = _STATES[workdir]
    raw = {"params": state["params"], "batch_stats": state["batch_stats"]}
    ema = {"params": _by_path(state, "ema_params"), "batch_stats": _by_path(state, "ema_batch_stats")}
    # the test means something only if the EMA differs from the raw model
    assert not np.allclose(ema["params"]["head"]["kernel"], raw["params"]["head"]["kernel"])
    mean = ("Transformer", "encoder_norm", "bn", "mean")
    flat_raw = traverse_util.flatten_dict(raw["batch_stats"])
    assert not np.allclose(traverse_util.flatten_dict(ema["batch_stats"])[mean], flat_raw[mean])
    return raw, ema


def test_predict_with_the_ema_weights_and_statistics(run, images, caplog):
    raw, ema = _arrays(run)
    argv = [f"--workdir={run}", "--images=" + ",".join(images), "--top_k=10"]
    rows, _ = predict.main(argv + ["--weights=ema"])
    np.testing.assert_allclose(_probs(rows), _reference(run, images, ema), atol=1e-6)
    with caplog.at_level(logging.WARNING):
        default, _ = predict.main(argv)
    raw_rows, _ = predict.main(argv + ["--weights=raw"])
    want = _reference(run, images, raw)
    np.testing.assert_allclose(_probs(default), want, atol=1e-6)
    np.testing.assert_allclose(_probs(raw_rows), want, atol=1e-6)
    notes = [r.getMessage() for r in caplog.records if "EMA" in r.getMessage()]
    assert len(notes) == 1 and "using the raw weights; --weights=ema uses the EMA" in notes[0]


def test_export_npz_and_artifact_hold_the_ema_weights(run, images, tmp_path, capsys):
    from normvit_jax.deploy import artifact, runtimes
    raw, ema = _arrays(run)
    flat = export.run(run, str(tmp_path / "ema.npz"), weights="ema")
    assert "the ema weights of step 3" in capsys.readouterr().out
    want = traverse_util.flatten_dict(ema["params"], sep="/")
    assert set(want) <= set(flat)
    for k, v in want.items():
        np.testing.assert_array_equal(flat[k], v, err_msg=k)
    with np.load(tmp_path / "ema.npz") as f:
        np.testing.assert_array_equal(f["head/kernel"], ema["params"]["head"]["kernel"])
    flat = export.run(run, str(tmp_path / "raw.npz"))  # the default: unchanged
    np.testing.assert_array_equal(flat["head/kernel"], raw["params"]["head"]["kernel"])

    x = _decoded(run, images)
    for fold in (False, True):
        out = str(tmp_path / f"model_{fold}.stablehlo")
        meta = export.run_deploy(run, out, "stablehlo", fold=fold, weights="ema")
        assert meta["source"]["weights"] == "ema" and meta["source"]["step"] == 3
        assert meta["source"]["norm_statistics"] == "ema"
        assert artifact.read_metadata(out)[0]["source"]["weights"] == "ema"
        probs, _ = runtimes.open_artifact(out, "stablehlo")(x)
        np.testing.assert_allclose(probs, _reference(run, images, ema), atol=1e-5)
    meta = export.run_deploy(run, str(tmp_path / "raw.stablehlo"), "stablehlo")
    assert meta["source"]["weights"] == "raw"


def test_reparam_folds_the_ema_model_and_records_it(run, images, tmp_path):
    _, ema = _arrays(run)
    out = tmp_path / "folded"
    result = reparam.main([f"--workdir={run}", "--weights=ema", "--reps=1", f"--out={out}"])
    assert result["folded"]
    source = json.loads((out / "model.json").read_text())["source"]
    assert source == {"workdir": run, "weights": "ema", "norm_statistics": "ema", "step": 3}
    rows, _ = predict.main([f"--workdir={run}", f"--folded={out}", "--top_k=10",
                            "--images=" + ",".join(images)])
    np.testing.assert_allclose(_probs(rows), _reference(run, images, ema), atol=1e-5)
    # an artifact of the folder says which weights it holds
    meta = export.run_deploy(run, str(tmp_path / "f.stablehlo"), "stablehlo", folded=str(out))
    assert meta["source"]["weights"] == "ema" and meta["source"]["folded_dir"] == str(out)


def test_ema_statistics_not_averaged_take_the_raw_ones(run):
    """config.ema_batch_stats=False: the EMA weights with the raw statistics, as eval/ema_*."""
    state, _ = checkpoints.load_state(run)
    entry = checkpoints.ema_of(state)
    entry["ema_batch_stats"] = None
    variables, record = checkpoints.choose_weights(state, "ema", run)
    assert variables["batch_stats"] is state["batch_stats"]
    assert variables["params"] is _by_path(state, "ema_params")
    assert record["norm_statistics"].startswith("raw")


def _exit_2(call, capsys, *words) -> None:
    with pytest.raises(SystemExit) as e:
        call()
    assert e.value.code == 2
    err = capsys.readouterr().err  # (TensorFlow's start-up lines too, when it is first imported)
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and "Traceback" not in err and all(w in lines[0] for w in words), err


def test_no_ema_and_weights_beside_a_folded_folder_are_one_line(run, images, tmp_path, capsys):
    plain = _train(str(tmp_path / "plain"))
    argv = ["--images=" + ",".join(images)]
    _exit_2(lambda: predict.main([f"--workdir={plain}", "--weights=ema"] + argv), capsys,
            "--weights=ema: the run", "keeps no EMA")
    _exit_2(lambda: reparam.main([f"--workdir={plain}", "--weights=ema"]), capsys, "keeps no EMA")
    _exit_2(lambda: predict.main([f"--workdir={run}", "--weights=ema", "--folded=x"] + argv),
            capsys, "holds one folded model")
    _exit_2(lambda: predict.main([f"--workdir={run}", "--weights=ema", "--mode=eval"]), capsys,
            "--mode=eval reports both")
    with pytest.raises(ValueError, match="keeps no EMA"):
        export.run(plain, str(tmp_path / "x.npz"), weights="ema")
    from normvit_jax.deploy import DeployError
    with pytest.raises(DeployError, match="without --weights"):
        export.run_deploy(run, str(tmp_path / "x.stablehlo"), "stablehlo", folded="x",
                          weights="ema")
    assert not (tmp_path / "x.npz").exists()


def test_recalibrate_re_estimates_the_ema_statistics_at_the_ema_weights(run, tmp_path, capsys):
    """The EMA's statistics replaced, the raw model untouched; block 0's first slot against the
    numpy float64 running average (momentum 0.1) of its input under the EMA weights."""
    from normvit_jax import recalibrate
    from tests.test_recalibrate import first_slot_reference
    raw, ema = _arrays(run)
    out = tmp_path / "recal"
    result = recalibrate.main([f"--workdir={run}", f"--out={out}", "--batches=2", "--weights=ema"])
    assert result["weights"] == "ema" and "before (EMA weights): top-1" in capsys.readouterr().out
    new_raw, new_ema = _arrays(str(out))
    for a, b in ((raw, new_raw), (ema["params"], new_ema["params"])):
        for k, v in traverse_util.flatten_dict(a).items():
            np.testing.assert_array_equal(traverse_util.flatten_dict(b)[k], v)
    mean, var = first_slot_reference(run, ema, 2)
    got = new_ema["batch_stats"]["Transformer"]["encoderblock_0"]["LayerNorm_0"]["bn"]
    np.testing.assert_allclose(got["mean"], mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["var"], var, rtol=1e-5)


def test_init_from_naming_a_run_with_an_ema_names_the_flag(run, tmp_path):
    """Fine-tuning from a run goes through its .npz export, which takes the raw weights unless
    told: the hint for init_from=<workdir> says how to export the EMA."""
    from normvit_jax import preflight
    with pytest.raises(ValueError, match=r"keeps a weight EMA \(config.ema_decay=0.5\): add "
                                         r"--weights=ema to export it"):
        preflight.check(tiny_demo_config(init_from=run), str(tmp_path / "new"))


def test_the_analysis_loads_the_ema_model(run):
    from normvit_jax.analysis import capture
    _, ema = _arrays(run)
    loaded = capture.load_run(run, weights="ema")
    assert (loaded.weights, loaded.step) == ("ema", 3)
    for part in ("params", "batch_stats"):
        got = traverse_util.flatten_dict(loaded.variables[part])
        for k, v in traverse_util.flatten_dict(ema[part]).items():
            np.testing.assert_array_equal(got[k], v)
    assert capture.load_run(run, weights="raw").weights == "raw"


def test_a_run_whose_ema_kept_the_raw_statistics(images, tmp_path, capsys):
    """config.ema_batch_stats=False: --weights=ema is the EMA params with the raw statistics (what
    its eval/ema_* measured); recalibrate has nowhere to keep EMA statistics: one line, exit 2."""
    from normvit_jax import recalibrate
    w = _train(str(tmp_path / "run"), ema_decay=0.5, ema_batch_stats=False,
               **{"model.norm": {"name": "repbn"}})
    state, _ = checkpoints.load_state(w)
    assert not _by_path(state, "ema_batch_stats")
    want = {"params": _by_path(state, "ema_params"), "batch_stats": state["batch_stats"]}
    rows, _ = predict.main([f"--workdir={w}", "--weights=ema", "--top_k=10",
                            "--images=" + ",".join(images)])
    np.testing.assert_allclose(_probs(rows), _reference(w, images, want), atol=1e-6)
    _exit_2(lambda: recalibrate.main([f"--workdir={w}", f"--out={tmp_path / 'o'}",
                                      "--weights=ema"]), capsys, "config.ema_batch_stats=False")
