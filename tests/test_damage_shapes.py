"""A walker's damaged copies of a finished run (checkpoints at steps 2, 4 and 6): a workdir part
that is a file, a symbolic link loop, a folder where a file belongs, an emptied checkpoint folder,
a damaged step asked for with --step, a step folder under another name and a stray half-written
save. docs/faults.md promises one line with a documented exit code, no traceback and nothing lost.
Training and --mode=eval run through cli.run / cli.evaluate and predict through its main, in this
process (the subprocess paths are tests/test_tools_restore.py's)."""
from __future__ import annotations

import logging
import os
import shutil

import pytest

from normvit_jax import checkpoints, cli, predict, run_config
from normvit_jax.train import loop
from tests.conftest import tiny_demo_config
from tests.test_tools_restore import _truncate_data


def _config():
    return tiny_demo_config(total_steps=6, checkpoint_every=2, eval_every=6,
                            **{"model.depth": 1})


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> str:
    wd = str(tmp_path_factory.mktemp("shapes") / "run")
    loop.train_and_evaluate(_config(), wd)
    assert checkpoints.complete_steps(wd) == [2, 4, 6]
    return wd


def _copy(run: str, dest) -> str:
    shutil.copytree(run, dest, ignore=shutil.ignore_patterns(".lock"), symlinks=True)
    return str(dest)


def _predict(wd: str, tmp_path, capsys) -> tuple[int, list[str]]:
    """(exit code, stderr lines) of predict on ``wd``."""
    from PIL import Image
    import numpy as np
    Image.fromarray(np.full((8, 8, 3), 128, np.uint8)).save(tmp_path / "img.png")
    capsys.readouterr()
    try:
        predict.main([f"--workdir={wd}", f"--images={tmp_path}/img.png"])
        code = 0
    except SystemExit as e:
        code = e.code
    return code, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def _stopped(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("Stopped:")]


def _not_a_folder(path: str, shape: str) -> str:
    """Makes ``path`` a file ("file") or a symbolic link to itself ("loop"); the words the tools
    name it with."""
    if shape == "file":
        with open(path, "w") as f:
            f.write("not a folder")
        return "is a file, not a directory"
    os.symlink(os.path.basename(path), path)
    return "is a symbolic link loop"


@pytest.mark.parametrize("shape", ["file", "loop"])
def test_a_checkpoints_path_that_is_no_folder_is_one_line_everywhere(run, tmp_path, capsys,
                                                                    caplog, shape):
    """Items 1 and 2: a file (NotADirectoryError tracebacks, exit 1) or a symbolic link loop
    (FileExistsError from os.makedirs; the tools said "the run has not saved one yet")."""
    wd = _copy(run, tmp_path / "wd")
    ckpt = os.path.join(wd, "checkpoints")
    shutil.rmtree(ckpt)
    what = _not_a_folder(ckpt, shape)
    code, err = _predict(wd, tmp_path, capsys)
    assert code == cli.EXIT_CONFIG and len(err) == 1, err
    assert f"{ckpt} {what}" in err[0] and "not saved one yet" not in err[0], err
    with pytest.raises(Exception) as e:
        checkpoints.restore_numpy(wd)
    assert cli.exit_code(e.value) == cli.EXIT_CONFIG and what in str(e.value)
    for name, call in (("eval", lambda: cli.evaluate(_config(), wd)),
                       ("train", lambda: cli.run(_config(), wd))):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="absl"):
            assert call() == cli.EXIT_CONFIG, name
        lines = _stopped(caplog)
        assert len(lines) == 1 and f"{ckpt} {what}" in lines[0], (name, lines)
    assert os.path.islink(ckpt) if shape == "loop" else open(ckpt).read() == "not a folder"


def test_a_damaged_checkpoints_file_stops_before_moving_anything(run, tmp_path, caplog):
    """Item 3: FileExistsError from quarantine's mkdir (exit 1); now one line, nothing moved."""
    wd = _copy(run, tmp_path / "wd")
    _truncate_data(os.path.join(wd, "checkpoints", "6"))
    damaged = os.path.join(wd, "damaged_checkpoints")
    with open(damaged, "w") as f:
        f.write("x")
    with caplog.at_level(logging.INFO, logger="absl"):
        assert cli.run(_config(), wd) == cli.EXIT_CONFIG
    lines = _stopped(caplog)
    assert len(lines) == 1 and f"{damaged} is a file, not a directory" in lines[0], lines
    assert "step 6" in lines[0] and "nothing was moved" in lines[0], lines
    assert sorted(os.listdir(os.path.join(wd, "checkpoints"))) == ["2", "4", "6"]
    assert open(damaged).read() == "x"


def test_a_lock_that_is_a_folder_or_not_text(run, tmp_path, caplog):
    """Item 4: IsADirectoryError (exit 1); non-UTF-8 bytes stopped with a bare codec error."""
    wd = _copy(run, tmp_path / "wd")
    lock = os.path.join(wd, ".lock")
    os.mkdir(lock)
    with caplog.at_level(logging.INFO, logger="absl"):
        assert cli.run(_config(), wd) == cli.EXIT_CONFIG
    lines = _stopped(caplog)
    assert len(lines) == 1 and f"{lock} is a folder" in lines[0], lines
    assert os.path.isdir(lock)
    os.rmdir(lock)
    with open(lock, "wb") as f:
        f.write(b"\xff\xfe\x00garbage")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="absl"):
        assert cli.run(_config(), wd) == cli.EXIT_OK  # taken over as a garbage lock is
    assert not _stopped(caplog)
    assert any("Taking over" in r.getMessage() and lock in r.getMessage()
               for r in caplog.records)


def test_emptied_checkpoints_of_a_run_that_got_further_are_named(run, tmp_path, capsys, caplog):
    """Item 5: training restarted at step 0 ("ended before its first checkpoint", false) and the
    tools said "the run has not saved one yet". Now training refuses (exit 2, naming --fresh)
    and writes nothing; the tools say the checkpoints are gone."""
    wd = _copy(run, tmp_path / "wd")
    ckpt = os.path.join(wd, "checkpoints")
    for name in os.listdir(ckpt):
        shutil.rmtree(os.path.join(ckpt, name))
    before = {n: os.path.getmtime(os.path.join(wd, n)) for n in os.listdir(wd)}
    with caplog.at_level(logging.INFO, logger="absl"):
        assert cli.run(_config(), wd) == cli.EXIT_CONFIG
    lines = _stopped(caplog)
    assert len(lines) == 1 and "step 6" in lines[0] and "--fresh" in lines[0], lines
    assert "gone" in lines[0] and ckpt in lines[0], lines
    # the lock and the start's own records (run_log: its lines, its failed end) aside
    from normvit_jax import run_log
    records = (".lock", run_log.LOG_NAME, run_log.STATUS_NAME)
    after = {n: os.path.getmtime(os.path.join(wd, n)) for n in os.listdir(wd) if n not in records}
    assert after == {n: t for n, t in before.items() if n not in records}
    status = run_log.read_status(wd)  # how the run ended kept; the refusal in last_start
    assert status["last_start"]["exit_code"] == cli.EXIT_CONFIG and status["state"] != "failed"
    assert os.listdir(ckpt) == []
    code, err = _predict(wd, tmp_path, capsys)
    assert code == cli.EXIT_CONFIG and len(err) == 1, err
    assert "step 6" in err[0] and "gone" in err[0] and "not saved one yet" not in err[0], err


def test_records_up_to_one_interval_are_a_crashed_first_save_not_gone_checkpoints(run, tmp_path):
    """A run killed while writing its first checkpoint has records up to that step (and, with the
    asynchronous save, a few past it) and no checkpoint: its re-run starts at 0 as documented.
    Records at two intervals mean a completed first save that has gone."""
    wd = _copy(run, tmp_path / "wd")  # records reach step 6
    ckpt = os.path.join(wd, "checkpoints")
    for name in os.listdir(ckpt):
        shutil.rmtree(os.path.join(ckpt, name))
    assert checkpoints.checkpoints_gone(wd, checkpoint_every=4) is None   # 6 < 8: first save
    assert checkpoints.checkpoints_gone(wd, checkpoint_every=6) is None   # 6 < 12
    gone = checkpoints.checkpoints_gone(wd, checkpoint_every=3)           # 6 >= 6
    assert gone is not None and "step 6" in gone and "gone" in gone


def test_a_damaged_step_asked_for_names_the_steps_that_exist(run, tmp_path, caplog):
    """Item 6: exit 4 "no checkpoint ... restores: step 6" left out that 2 and 4 restore."""
    wd = _copy(run, tmp_path / "wd")
    _truncate_data(os.path.join(wd, "checkpoints", "6"))
    with pytest.raises(checkpoints.CheckpointMismatchError) as e:
        checkpoints.restore_numpy(wd, 6)
    assert "step 6:" in str(e.value) and "steps 2, 4" in str(e.value)
    assert "leave out --step" in str(e.value)
    with caplog.at_level(logging.INFO, logger="absl"):
        assert cli.evaluate(_config(), wd, step=6) == cli.EXIT_CHECKPOINT
    lines = _stopped(caplog)
    assert len(lines) == 1 and "steps 2, 4" in lines[0] and "leave out --step" in lines[0], lines


@pytest.mark.parametrize("shape", ["file", "loop"])
def test_a_workdir_that_is_a_file_or_a_loop_is_named(tmp_path, capsys, caplog, shape):
    """Item 7: the tools said "holds no run" / "does not exist"; training "not writable
    (FileExistsError) ... fix its permissions" for a loop."""
    wd = str(tmp_path / "wd")
    what = _not_a_folder(wd, shape)
    code, err = _predict(wd, tmp_path, capsys)
    assert code == cli.EXIT_CONFIG and len(err) == 1 and f"{wd} {what}" in err[0], err
    with caplog.at_level(logging.INFO, logger="absl"):
        assert cli.run(_config(), wd) == cli.EXIT_WORKDIR
    lines = _stopped(caplog)
    assert len(lines) == 1 and what in lines[0] and "permissions" not in lines[0], lines


def test_a_step_folder_under_another_name_is_ignored_everywhere(run, tmp_path, capsys, caplog):
    """Item 8: '0006' was step 6 to the tools ("damaged: Directory does not exist .../6") and
    nothing to training, which resumed from 4 and wrote a 6 beside it without a word."""
    wd = _copy(run, tmp_path / "wd")
    ckpt = os.path.join(wd, "checkpoints")
    os.rename(os.path.join(ckpt, "6"), os.path.join(ckpt, "0006"))
    assert checkpoints.complete_steps(wd) == [2, 4]
    restored, _ = checkpoints.restore_numpy(wd)
    assert restored.step == 4 and not restored.damaged
    code, err = _predict(wd, tmp_path, capsys)
    assert code == 0 and not any("damaged" in line for line in err), err
    os.rename(os.path.join(ckpt, "4"), os.path.join(ckpt, "04"))
    os.rename(os.path.join(ckpt, "2"), os.path.join(ckpt, "x2"))
    assert not run_config.has_checkpoint(wd)  # as complete_steps: not a step name
    with caplog.at_level(logging.INFO, logger="absl"):
        checkpoints.make_manager(wd).close()  # training's manager: one warning names them
    notes = [r.getMessage() for r in caplog.records if "not step folders" in r.getMessage()]
    assert len(notes) == 1 and all(n in notes[0] for n in ("0006", "04", "x2")), notes
    assert sorted(os.listdir(ckpt)) == ["0006", "04", "x2"]


def test_a_stray_half_written_save_of_a_complete_run_is_said(run, tmp_path, caplog):
    """Item 9: a re-run of a complete run deleted it without a word (faults.md: left as it is)."""
    wd = _copy(run, tmp_path / "wd")
    tmp = os.path.join(wd, "checkpoints", "8.orbax-checkpoint-tmp-1700000000")
    os.makedirs(os.path.join(tmp, "state"))
    with caplog.at_level(logging.INFO, logger="absl"):
        assert cli.run(_config(), wd) == cli.EXIT_OK
    notes = [r.getMessage() for r in caplog.records if tmp in r.getMessage()]
    assert len(notes) == 1 and "half-written" in notes[0], notes
    assert not os.path.exists(tmp)
    assert checkpoints.complete_steps(wd) == [2, 4, 6]
