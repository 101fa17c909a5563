"""Continuing a run with another config: allow_config_change is a permission for one invocation,
keys that change neither the trained numbers nor the resume need none, a changed learning-rate
schedule is said in one line, a complete run is left untouched, and ``--mode=config`` prints the
resolved config without training."""
from __future__ import annotations

import glob
import json
import logging
import os
import subprocess
import sys

import pytest

from configs import run_config as run_config_file
from normvit_jax import cli, run_code, run_config
from normvit_jax.train import loop
from tests.conftest import REPO_ROOT
from tests.conftest import tiny_demo_config as _tiny_demo_config

pytestmark = pytest.mark.usefixtures("compile_cache")


def tiny_demo_config(**overrides):
    """The tiny demo with one block: what these tests check (the config, its records and lines,
    the resume) is the same at any depth."""
    return _tiny_demo_config(**{"model.depth": 1, **overrides})


def _saved(wd) -> dict:
    return json.load(open(os.path.join(wd, "config.json")))


def _messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records]


def test_allow_config_change_is_not_saved_and_a_saved_true_grants_nothing(tmp_path):
    """After a change made with --config.allow_config_change=True, the run's own config.json
    (main.py --config=W) continued with a changed learning rate without the flag: the saved True
    was read back. config.json records False, and an older file's True is read as False."""
    wd = str(tmp_path)
    loop.train_and_evaluate(tiny_demo_config(total_steps=2, checkpoint_every=2), wd)
    loop.train_and_evaluate(tiny_demo_config(total_steps=3, checkpoint_every=2,
                                             allow_config_change=True), wd)
    assert _saved(wd)["total_steps"] == 3 and _saved(wd)["allow_config_change"] is False
    own = run_config_file.get_config(wd)  # what --config=W reads
    assert own.allow_config_change is False
    own.optimizer.learning_rate = 5e-3
    with pytest.raises(run_config.ConfigChangedError, match="learning_rate: 0.003 -> 0.005"):
        run_config.check_config(own, wd)
    # a config.json written by an older version with the permission inside
    saved = _saved(wd)
    saved["allow_config_change"] = True
    open(os.path.join(wd, "config.json"), "w").write(json.dumps(saved))
    own = run_config_file.get_config(wd)
    assert own.allow_config_change is False
    own.optimizer.learning_rate = 5e-3
    with pytest.raises(run_config.ConfigChangedError):
        run_config.check_config(own, wd)


def test_refused_change_and_accepted_change_are_one_line_each(tmp_path, caplog):
    a = tiny_demo_config()
    b = tiny_demo_config(eval_every=25, **{"optimizer.learning_rate": 0.001})
    run_config.write_config(a, str(tmp_path))
    (tmp_path / "checkpoints" / "3").mkdir(parents=True)
    with pytest.raises(run_config.ConfigChangedError) as e:
        run_config.check_config(b, str(tmp_path))
    msg = str(e.value)
    assert "\n" not in msg, msg
    # eval_every needs no permission: only the learning rate is named
    assert "changed keys: optimizer.learning_rate: 0.003 -> 0.001; use another --workdir" in msg
    assert "eval_every" not in msg and "--config.allow_config_change=True" in msg
    b.allow_config_change = True
    run_config.check_config(b, str(tmp_path))
    with caplog.at_level(logging.INFO, logger="absl"):
        run_config.write_config(b, str(tmp_path))
    lines = [m for m in _messages(caplog) if str(tmp_path) in m]
    assert len(lines) == 2 and all("\n" not in m for m in lines), lines
    assert any("optimizer.learning_rate: 0.003 -> 0.001" in m and "eval_every" not in m
               for m in lines), lines
    assert any("eval_every: 6 -> 25" in m and "learning_rate" not in m for m in lines), lines
    assert _saved(tmp_path)["eval_every"] == 25 and _saved(tmp_path)["allow_config_change"] is False


def test_harmless_keys_change_without_the_flag_and_are_recorded(tmp_path, caplog):
    """--config.eval_every=25 --config.log_every=10 on a run was refused: neither changes the
    trained numbers nor the resume's exactness. Accepted with one info line, recorded."""
    wd = str(tmp_path)
    cfg = tiny_demo_config(total_steps=4, checkpoint_every=2, eval_every=4)
    loop.train_and_evaluate(cfg, wd, stop_at=2)
    changed = tiny_demo_config(total_steps=4, checkpoint_every=1, eval_every=3, log_every=1,
                               keep_checkpoints=5)
    with caplog.at_level(logging.INFO, logger="absl"):
        out = loop.train_and_evaluate(changed, wd)
    assert out["step"] == 4
    saved = _saved(wd)
    assert (saved["eval_every"], saved["log_every"], saved["checkpoint_every"],
            saved["keep_checkpoints"]) == (3, 1, 1, 5)
    lines = [m for m in _messages(caplog) if "eval_every: 4 -> 3" in m]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert "checkpoint_every: 2 -> 1" in lines[0] and "log_every: 2 -> 1" in lines[0]
    assert "keep_checkpoints: 3 -> 5" in lines[0]
    # checkpoints at 3 and 4 by the new checkpoint_every (2 was the first process's)
    assert sorted(int(os.path.basename(p)) for p in glob.glob(f"{wd}/checkpoints/*")
                  if os.path.basename(p).isdigit()) == [2, 3, 4]
    # exact: the same parameters as the unchanged run
    ref = str(tmp_path / "ref")
    loop.train_and_evaluate(cfg, ref)
    import jax
    import numpy as np

    from normvit_jax import checkpoints
    for x, y in zip(jax.tree.leaves(checkpoints.load_params(wd)[0]),
                    jax.tree.leaves(checkpoints.load_params(ref)[0])):
        np.testing.assert_array_equal(x, y)


def test_a_mesh_change_is_said_to_be_equal_up_to_float32_rounding(tmp_path, caplog):
    """mesh.* keys need no flag, but a changed mesh (or device count) is not bitwise: the
    all-reduce adds the devices' gradients in another order. The info line said such keys
    'change neither the trained numbers nor the resume'."""
    wd = str(tmp_path)
    run_config.write_config(tiny_demo_config(), wd)
    (tmp_path / "checkpoints" / "3").mkdir(parents=True)
    with caplog.at_level(logging.INFO, logger="absl"):
        run_config.write_config(tiny_demo_config(**{"mesh.fsdp": 2, "log_every": 1}), wd)
    (line,) = [m for m in _messages(caplog) if "mesh.fsdp: 1 -> 2" in m]
    assert "equal up to float32 rounding" in line and "rather than bit for bit" in line, line
    assert "change neither the trained numbers nor the resume" not in line, line
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="absl"):
        run_config.write_config(tiny_demo_config(**{"mesh.fsdp": 2, "log_every": 3}), wd)
    (line,) = [m for m in _messages(caplog) if "log_every: 1 -> 3" in m]
    assert "change neither the trained numbers nor the resume" in line and "float32" not in line


class _Mesh:
    """What guards reads of a jax Mesh: .shape (axis -> size) and .devices (an array)."""

    def __init__(self, data, fsdp):
        import numpy as np
        self.shape, self.devices = {"data": data, "fsdp": fsdp}, np.zeros((data, fsdp))


def test_mesh_change_note_names_both_meshes_and_is_silent_without_a_record():
    from normvit_jax.train import guards
    saved = guards.mesh_meta(_Mesh(8, 1), processes=1)
    assert saved == {"devices": 8, "processes": 1, "data": 8, "fsdp": 1}
    assert guards.mesh_change_note({"mesh": saved}, _Mesh(8, 1), processes=1) is None
    assert guards.mesh_change_note({}, _Mesh(4, 1), processes=1) is None  # an older checkpoint
    assert guards.mesh_change_note(None, _Mesh(4, 1), processes=1) is None
    assert guards.mesh_change_note({"mesh": saved}, _Mesh(4, 1), processes=1) == (
        "The run trained on 8 devices (mesh data=8 x fsdp=1) and continues on 4 (data=4 x "
        "fsdp=1): the same run, equal up to float32 rounding rather than bit for bit.")
    assert guards.mesh_change_note({"mesh": saved}, _Mesh(4, 2), processes=1) == (
        "The run trained on 8 devices (mesh data=8 x fsdp=1) and continues on 8 (data=4 x "
        "fsdp=2): the same run, equal up to float32 rounding rather than bit for bit.")
    two = guards.mesh_meta(_Mesh(4, 1), processes=2)
    assert guards.mesh_change_note({"mesh": two}, _Mesh(4, 1), processes=1) == (
        "The run trained on 4 devices in 2 processes (mesh data=4 x fsdp=1) and continues on 4 "
        "in 1 process (data=4 x fsdp=1): the same run, equal up to float32 rounding rather than "
        "bit for bit.")


def test_a_resume_on_another_device_count_says_so_in_one_line(tmp_path, caplog):
    """8 -> 4 devices with mesh.data=-1 (config.json unchanged) resumed with only 'Resumed from
    the checkpoint at step 35'. Each checkpoint now records its mesh; here the saved record says
    8 devices and the resume runs on this process's 1."""
    wd = str(tmp_path)
    loop.train_and_evaluate(tiny_demo_config(total_steps=4, checkpoint_every=2), wd, stop_at=2)
    (meta_file,) = [p for p in glob.glob(f"{wd}/checkpoints/2/meta/*") if "mesh" in open(p).read()]
    meta = json.load(open(meta_file))
    assert meta["mesh"] == {"devices": 1, "processes": 1, "data": 1, "fsdp": 1}
    meta["mesh"] = {"devices": 8, "processes": 1, "data": 8, "fsdp": 1}
    json.dump(meta, open(meta_file, "w"))
    with caplog.at_level(logging.INFO, logger="absl"):
        loop.train_and_evaluate(tiny_demo_config(total_steps=4, checkpoint_every=2), wd)
    lines = [m for m in _messages(caplog) if m.startswith("The run trained on")]
    assert lines == ["The run trained on 8 devices (mesh data=8 x fsdp=1) and continues on 1 "
                     "(data=1 x fsdp=1): the same run, equal up to float32 rounding rather than "
                     "bit for bit."], lines


def test_extending_a_run_says_how_the_learning_rate_changes(tmp_path, caplog):
    """A finished 4-step run extended to 8 steps: warmup 2, cosine to 0 over 2 steps (the rate
    at step 4 is 0) becomes a cosine over 6 steps (at step 4, 2 steps in: 0.003 * 0.75)."""
    wd = str(tmp_path)
    loop.train_and_evaluate(tiny_demo_config(total_steps=4, checkpoint_every=2), wd)
    with caplog.at_level(logging.INFO, logger="absl"):
        loop.train_and_evaluate(tiny_demo_config(total_steps=8, checkpoint_every=2,
                                                 allow_config_change=True), wd)
    lines = [m for m in _messages(caplog) if "learning rate at step" in m]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert ("The learning rate at step 4 goes from 0 (the run's schedule over 4 steps) to "
            "0.00225 (the new one over 8 steps)") in lines[0], lines
    # a change that does not touch the schedule says nothing about it
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="absl"):
        loop.train_and_evaluate(tiny_demo_config(total_steps=8, checkpoint_every=2,
                                                 label_smoothing=0.0, allow_config_change=True),
                                wd)
    assert not [m for m in _messages(caplog) if "learning rate at step" in m]


def _snapshot(wd) -> dict:
    """The run's files; the lock and the records of each start (training.log, status.json:
    run_log) are left out: a re-run appends its lines and records its end there."""
    from normvit_jax import run_log
    out = {}
    for name in sorted(os.listdir(wd)):
        p = os.path.join(wd, name)
        if os.path.isfile(p) and name not in (".lock", run_log.LOG_NAME, run_log.STATUS_NAME):
            out[name] = (open(p, "rb").read(), os.stat(p).st_mtime_ns)
    return out


def test_a_complete_run_is_left_untouched(tmp_path, caplog):
    """A plain re-run of a finished run rewrote config.json, classes.json, data.json and added a
    start to code.jsonl (and an event file); a total_steps below the run's step with
    allow_config_change rewrote config.json to a length shorter than the run."""
    wd = str(tmp_path)
    cfg = tiny_demo_config(total_steps=4, checkpoint_every=2)
    loop.train_and_evaluate(cfg, wd)
    before = _snapshot(wd)
    assert run_code.HISTORY_NAME in before and "classes.json" in before
    again = loop.train_and_evaluate(cfg, wd)
    assert again["step"] == 4
    assert _snapshot(wd) == before
    shorter = tiny_demo_config(total_steps=2, checkpoint_every=2, allow_config_change=True)
    with caplog.at_level(logging.INFO, logger="absl"):
        assert cli.run(shorter, wd) == cli.EXIT_CONFIG
    stopped = [m for m in _messages(caplog) if m.startswith("Stopped:")]
    assert len(stopped) == 1 and "\n" not in stopped[0], stopped
    assert "at step 4" in stopped[0] and "total_steps=2" in stopped[0], stopped
    assert _snapshot(wd) == before
    assert not [m for m in _messages(caplog) if "already complete" in m]
    from normvit_jax import run_log
    # the refused start overwrote the finished run's status with 'failed': status.json keeps how
    # the run ended, the refusal in last_start and training.log
    status = run_log.read_status(wd)
    assert (status["state"], status["step"], status["exit_code"]) == ("finished", 4, 0), status
    assert (status["last_start"]["state"], status["last_start"]["exit_code"]) == (
        "refused", cli.EXIT_CONFIG), status
    assert "total_steps=2" in status["last_start"]["message"], status
    log = open(os.path.join(wd, run_log.LOG_NAME)).read().rstrip().splitlines()
    assert "Start refused (exit 2): nothing trained" in log[-2] and "finished" in log[-2], log[-3:]


def test_a_complete_run_without_config_json_gets_it_back_with_the_flag(tmp_path):
    """The refusal of checkpoints without config.json says --config.allow_config_change=True
    takes the given config; on a complete run the re-run wrote nothing (a complete run is left
    as it is), so the tools kept refusing and the advice went round in a circle."""
    from normvit_jax import checkpoints
    wd = str(tmp_path)
    cfg = tiny_demo_config(total_steps=2, checkpoint_every=2)
    loop.train_and_evaluate(cfg, wd)
    saved = _saved(wd)
    os.remove(os.path.join(wd, "config.json"))
    with pytest.raises(checkpoints.RunNotFoundError):
        checkpoints.require_run(wd)
    again = loop.train_and_evaluate(tiny_demo_config(total_steps=2, checkpoint_every=2,
                                                     allow_config_change=True), wd)
    assert again["step"] == 2
    assert _saved(wd) == saved  # the same config, the permission recorded False
    checkpoints.require_run(wd)  # the tools take the run again


def _main(*args):
    return subprocess.run([sys.executable, os.path.join(REPO_ROOT, "main.py"), *args],
                          cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": REPO_ROOT},
                          capture_output=True, text=True, timeout=240)


def test_mode_config_prints_the_resolved_config(tmp_path):
    r = _main("--mode=config", "--config=configs/vit_dtn.py:deit_s",
              "--config.total_steps=7", "--config.optimizer.learning_rate=2e-3",
              "--config.allow_config_change=True")
    assert r.returncode == 0, r.stderr[-2000:]
    shown = json.loads(r.stdout)
    from configs import vit_dtn
    want = json.loads(vit_dtn.get_config("deit_s").to_json_best_effort())
    want.update(total_steps=7, allow_config_change=False)
    want["optimizer"]["learning_rate"] = 2e-3
    assert shown == want
    assert not (tmp_path / "x").exists()
    # an invalid value is refused as training refuses it: one line, exit 2
    r = _main("--mode=config", "--config=configs/vit_ln.py:demo", "--config.total_steps=0")
    assert r.returncode == cli.EXIT_CONFIG and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        "error: config.total_steps=0 must be None (use num_epochs) or an integer >= 1"], r.stderr
    # a norm option out of range or None (checked when a norm is built: --mode=config printed
    # it with exit 0), the block norm's and a per-slot override's
    for option, line in (("model.norm.epsilon=None", "epsilon=None is not accepted"),
                         ("model.norm_overrides.final.epsilon=-2", "epsilon=-2 is out of range")):
        extra = (["--config.model.norm_overrides.final.name=layernorm"]
                 if "overrides" in option else [])
        r = _main("--mode=config", "--config=configs/vit_ln.py:demo", *extra, f"--config.{option}")
        assert r.returncode == cli.EXIT_CONFIG and r.stdout == "", r.stderr[-2000:]
        assert len(r.stderr.strip().splitlines()) == 1 and line in r.stderr, r.stderr
    # a run's workdir: its own config.json (with overrides)
    wd = tmp_path / "run"
    wd.mkdir()
    saved = json.loads(tiny_demo_config().to_json_best_effort())
    (wd / "config.json").write_text(json.dumps(saved))
    r = _main("--mode=config", f"--workdir={wd}", "--config.eval_every=5")
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout) == {**saved, "eval_every": 5}


def test_checkpoints_without_config_json_are_refused_in_one_line(tmp_path, caplog):
    """config.json gone while checkpoints are present: a re-run with another learning rate
    resumed without a word and wrote a config.json recording it, as if the run had trained
    with it. Now: one line (exit 2) naming what is missing and the ways out; with
    allow_config_change the given config is taken, said in one warning line."""
    wd = str(tmp_path)
    run_config.write_config(tiny_demo_config(), wd)
    (tmp_path / "checkpoints" / "3").mkdir(parents=True)
    os.remove(os.path.join(wd, "config.json"))
    changed = tiny_demo_config(**{"optimizer.learning_rate": 0.0123})
    with pytest.raises(run_config.ConfigChangedError) as e:
        run_config.check_config(changed, wd)
    msg = str(e.value)
    assert "\n" not in msg and cli.exit_code(e.value) == cli.EXIT_CONFIG
    assert f"{wd} holds checkpoints but no config.json" in msg, msg
    assert "--config.allow_config_change=True" in msg and "--fresh" in msg
    assert "config.before-" not in msg  # none to restore from
    (tmp_path / "config.before-20260101T000000Z.json").write_text("{}")
    with pytest.raises(run_config.ConfigChangedError, match=r"config\.before-20260101T000000Z"
                                                            r"\.json"):
        run_config.check_config(changed, wd)
    changed.allow_config_change = True
    run_config.check_config(changed, wd)
    with caplog.at_level(logging.WARNING, logger="absl"):
        run_config.write_config(changed, wd)
    lines = [m for m in _messages(caplog) if "no config.json" in m]
    assert len(lines) == 1 and "0.0123" not in lines[0] and wd in lines[0], lines
    assert _saved(wd)["optimizer"]["learning_rate"] == 0.0123


def test_tools_on_checkpoints_without_config_json_do_not_say_train_one(tmp_path):
    from normvit_jax import checkpoints
    (tmp_path / "checkpoints" / "3").mkdir(parents=True)
    with pytest.raises(checkpoints.RunNotFoundError) as e:
        checkpoints.require_run(str(tmp_path))
    msg = str(e.value)
    assert "train one there first" not in msg and "holds checkpoints but no config.json" in msg
    assert "restore" in msg and "--config.allow_config_change=True" in msg
    r = _main("--mode=eval", f"--workdir={tmp_path}")
    assert r.returncode == cli.EXIT_CONFIG
    assert "train one there first" not in r.stderr
    assert "holds checkpoints but no config.json" in r.stderr, r.stderr[-2000:]
