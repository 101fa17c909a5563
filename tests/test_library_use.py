"""``train_and_evaluate`` and ``predict`` called from Python (a notebook, a script), not through
main.py: the same config checks and CPU numerics, the same training.log, the caller's logging
left as it was, and the arguments a Python caller passes."""
import logging
import os

import numpy as np
import pytest
from absl import logging as absl_logging

from normvit_jax import predict, preflight, reproducible, run_log
from normvit_jax.train import loop
from tests.conftest import tiny_demo_config

pytestmark = pytest.mark.usefixtures("compile_cache")


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture(scope="module")
def library_run(tmp_path_factory):
    """A tiny run trained from Python with absl at WARNING (absl's level outside absl.app), then
    re-run once finished with absl at INFO; (workdir, first result, re-run result, the records
    the caller's own handler on the root logger saw, the absl logger's state before and after)."""
    wd = str(tmp_path_factory.mktemp("lib") / "run")
    absl = absl_logging.get_absl_logger()
    level0 = absl.level
    mine = _Records()
    root = logging.getLogger()
    saved_threads = os.environ.pop(reproducible.THREADS_ENV, None)  # not pinned in this process
    handlers0 = list(root.handlers)  # without absl.app's handler (a test may have run absl.app)
    root.handlers[:] = [h for h in handlers0 if h is not absl_logging.get_absl_handler()] + [mine]
    try:
        absl.setLevel(logging.WARNING)
        before = (absl.level, list(absl.filters), list(absl.handlers))
        config = tiny_demo_config(total_steps=4, eval_every=4, checkpoint_every=4)
        first = loop.train_and_evaluate(config, wd)
        after = (absl.level, list(absl.filters), list(absl.handlers))
        seen = list(mine.records)
        absl.setLevel(logging.INFO)  # absl.logging.set_verbosity(INFO) in a notebook
        again = loop.train_and_evaluate(tiny_demo_config(total_steps=4, eval_every=4,
                                                         checkpoint_every=4), wd)
        again_after = absl.level
    finally:
        absl.setLevel(level0)
        root.handlers[:] = handlers0
        if saved_threads is not None:
            os.environ[reproducible.THREADS_ENV] = saved_threads
    return dict(wd=wd, first=first, again=again, seen=seen, before=before, after=after,
                again_after=again_after)


def _starts(wd) -> list[str]:
    """training.log's text of each start."""
    text = open(os.path.join(wd, run_log.LOG_NAME)).read()
    return ["----- training start" + part for part in text.split("----- training start")[1:]]


def test_training_log_holds_the_run_lines_and_logging_is_left_as_it_was(library_run):
    first, second = _starts(library_run["wd"])
    assert "step 2/4: loss" in first and "step 4/4: loss" in first, first
    assert "eval at step 4:" in first and "Run ended: finished at step 4 (exit 0)." in first, first
    assert "Run ended: finished at step 4 (exit 0)." in second, second
    for text in (first, second):  # absl at INFO: Orbax's chatter stays out of the file
        assert "orbax" not in text.lower() and "CheckpointManager" not in text, text
    # the caller's handler saw no INFO line (absl was at WARNING), and the absl logger's level,
    # filters and handlers are as they were
    assert not [r.getMessage() for r in library_run["seen"] if r.levelno < logging.WARNING]
    assert library_run["after"] == library_run["before"]
    assert library_run["again_after"] == logging.INFO


def test_an_unpinned_backend_is_a_warning_naming_the_key(library_run):
    warned = [r.getMessage() for r in library_run["seen"]
              if "config.reproducible_cpu_threads=2 is not applied" in r.getMessage()]
    assert len(warned) == 1 and r"reproducible.apply(2)" in warned[0], warned
    assert r"config.reproducible_cpu_threads=0" in warned[0]


def test_a_finished_run_returns_its_eval_as_a_fresh_one_does(library_run):
    first, again = library_run["first"]["eval"], library_run["again"]["eval"]
    assert {k: type(v) for k, v in again.items()} == {k: type(v) for k, v in first.items()}
    assert list(again) == list(first)
    assert again["num_examples"] == first["num_examples"] == 355
    assert again["top1"] == pytest.approx(first["top1"])


def test_the_pinning_is_applied_when_the_backend_has_not_started(monkeypatch, tmp_path):
    """A call made before anything used JAX pins the numerics as main.py does (here the backend
    runs already: only the environment JAX would read is checked)."""
    monkeypatch.setattr(reproducible, "backend_started", lambda: False)
    monkeypatch.delenv(reproducible.THREADS_ENV, raising=False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")

    class Stop(Exception):
        pass

    def stop(fresh):
        raise Stop
    monkeypatch.setattr(loop.workdir_lib, "rerun_advice", stop)  # right after the start checks
    with pytest.raises(Stop):
        loop.train_and_evaluate(tiny_demo_config(), str(tmp_path / "run"))
    assert os.environ[reproducible.THREADS_ENV] == "2"
    assert "--xla_cpu_max_isa=AVX2" in os.environ["XLA_FLAGS"]
    assert os.environ["XLA_FLAGS"].startswith("--xla_backend_optimization_level=0 ")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("setting, message", [
    (("optimizer", "learnig_rate", 0.5),
     r"unknown config key config.optimizer.learnig_rate \(did you mean "
     r"config.optimizer.learning_rate\?\)"),
    ((None, "init_from", ""), r"config.init_from is empty \(an unset shell variable\?\)"),
])
def test_the_cli_config_checks_run_for_a_library_call(tmp_path, setting, message):
    config = tiny_demo_config()
    group, key, value = setting
    (config[group] if group else config)[key] = value
    wd = tmp_path / "run"
    with pytest.raises(ValueError, match=message):
        loop.train_and_evaluate(config, str(wd))
    assert not wd.exists()  # refused before anything was written


def test_a_locked_config_keeps_its_config_files_keys():
    """main.py's config is locked (a misspelt override is refused there): a key its config file
    added is the file's business, as it was."""
    config = tiny_demo_config()
    config.my_note = "x"
    with pytest.raises(ValueError, match=r"unknown config key config.my_note:"):
        preflight.check_keys(config)
    config.lock()
    preflight.check_keys(config)
    t2t = __import__("configs.vit_ln", fromlist=["x"]).get_config("t2t_vit_14")
    preflight.check_keys(t2t)  # a config file's own additions (T2T-ViT's keys) are known


def test_predict_takes_a_folder_path_and_names_what_it_takes(library_run, tmp_path):
    from PIL import Image
    folder = tmp_path / "imgs"
    folder.mkdir()
    for i in range(3):
        Image.fromarray(np.full((8, 8, 3), 40 * i, np.uint8)).save(folder / f"d{i}.png")
    for given in (str(folder), folder):
        rows, skipped = predict.predict(library_run["wd"], given, top_k=2)
        assert [r["path"] for r in rows] == [str(folder / f"d{i}.png") for i in range(3)]
        assert skipped == [] and len(rows[0]["top"]) == 2
    with pytest.raises(TypeError, match=r"files\[0\] is numpy.ndarray \(an image in memory"):
        predict.predict(library_run["wd"], [np.zeros((8, 8, 3), np.uint8)])
    with pytest.raises(TypeError, match=r"takes image files: .*; got numpy.ndarray"):
        predict.predict(library_run["wd"], np.zeros((8, 8, 3), np.uint8))
