"""workdir/code.jsonl (normvit_jax/run_code.py): every training start records the code that runs
and the step it starts from; a resume on other code says so in one warning line and trains on."""
import json
import logging
import os

import pytest

from normvit_jax import run_code
from normvit_jax import workdir as workdir_lib
from normvit_jax.train import loop
from tests.conftest import tiny_demo_config

pytestmark = pytest.mark.usefixtures("compile_cache")

CHANGED = "code changed since this run's last start"


def _history(wd) -> list[dict]:
    return [json.loads(line) for line in (wd / run_code.HISTORY_NAME).read_text().splitlines()]


def _warned(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if CHANGED in r.getMessage()]


def _train(wd, caplog, stop_at=None) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="absl"):
        loop.train_and_evaluate(tiny_demo_config(total_steps=4, checkpoint_every=2, eval_every=4),
                                str(wd), stop_at=stop_at)
    return _warned(caplog)


def test_resume_on_other_code_warns_once_and_history_grows(tmp_path, caplog, monkeypatch):
    wd = tmp_path / "run"
    assert _train(wd, caplog, stop_at=2) == []
    first = _history(wd)
    assert [e["step"] for e in first] == [0]
    assert first[0]["versions"]["jax"] and first[0]["versions"]["numpy"]
    real = run_code.current()
    # a resume on a newer jax and another commit: what an upgrade or a pull between runs does
    monkeypatch.setattr(run_code, "current", lambda: {
        **real, "commit": "6e0ab85" + "0" * 33, "versions": {**real["versions"], "jax": "99.0"}})
    warned = _train(wd, caplog)
    assert len(warned) == 1 and "\n" not in warned[0], warned
    assert "at step 0 (resuming at step 2):" in warned[0]
    assert f"jax {real['versions']['jax']} -> 99.0" in warned[0]
    assert "-> 6e0ab85" in warned[0] and "numpy" not in warned[0]
    assert [e["step"] for e in _history(wd)] == [0, 2]  # the second start continued from step 2
    assert _history(wd)[1]["versions"]["jax"] == "99.0"


def test_identical_resume_and_workdir_without_history(tmp_path, caplog):
    wd = tmp_path / "run"
    _train(wd, caplog, stop_at=2)
    os.remove(wd / run_code.HISTORY_NAME)  # a workdir written before code.jsonl existed
    assert _train(wd, caplog, stop_at=4) == []  # resumes; starts the history at its step
    assert [e["step"] for e in _history(wd)] == [2]
    # the same code again on the complete run: no warning, and no start is recorded (a complete
    # run is left as it is, docs/faults.md)
    assert _train(wd, caplog) == []
    assert [e["step"] for e in _history(wd)] == [2]
    # --fresh moves the history aside with the run: the new run has its own
    moved = workdir_lib.move_run_aside(str(wd))
    assert os.path.exists(os.path.join(moved, run_code.HISTORY_NAME))
    assert not (wd / run_code.HISTORY_NAME).exists()


def test_no_git_records_no_commit(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no git executable to run
    code = run_code.current()
    assert "commit" not in code and "dirty" not in code and code["versions"]["numpy"]
    monkeypatch.undo()
    monkeypatch.setattr(run_code, "SOURCE_ROOT", str(tmp_path))  # a pip-installed copy: no .git
    assert "commit" not in run_code.current()


def test_a_history_that_cannot_be_written_is_logged_not_raised(tmp_path, caplog):
    (tmp_path / run_code.HISTORY_NAME).mkdir()  # an odd workdir: a folder where the file goes
    with caplog.at_level(logging.WARNING, logger="absl"):
        run_code.record_start(str(tmp_path), 3)
    assert any("Could not record the code" in r.getMessage() for r in caplog.records)
