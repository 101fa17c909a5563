"""A run's lifecycle pieces that need no training: the step policy's ladder, the one table of exit
codes, and the offline Google Cloud credential check."""
from __future__ import annotations

import os
import sys
import threading
import time

import pytest

from normvit_jax import checkpoints, cli, distributed, preflight, run_config, workdir
from normvit_jax.data import DatasetNotFoundError
from normvit_jax.train import policy
from tests.conftest import detach_run_logs, tiny_demo_config


def test_step_policy_ladder():
    """log every 2, eval every 3, save every 4 of 10 steps: each action on exactly the steps the
    rules name (written out by hand), a save that is not a log step still checked."""
    p = policy.StepPolicy(log_every=2, eval_every=3, checkpoint_every=4, n_steps=10)
    acts = {s: p.after(s) for s in range(1, 11)}
    assert [s for s, a in acts.items() if a.log] == [2, 4, 6, 8, 10]
    assert [s for s, a in acts.items() if a.evaluate] == [3, 6, 9, 10]
    assert [s for s, a in acts.items() if a.save] == [4, 8, 10]
    assert [s for s, a in acts.items() if a.check] == [2, 4, 6, 8, 10]
    assert not any(a.pause or a.preempt for a in acts.values())
    odd = policy.StepPolicy(log_every=3, eval_every=100, checkpoint_every=2, n_steps=7, stop_at=5)
    a5 = odd.after(5)
    assert (a5.log, a5.check, a5.save, a5.pause) == (False, True, True, True)
    assert [s for s in range(1, 8) if odd.after(s).check] == [2, 3, 4, 5, 6, 7]
    assert not odd.after(7).pause and odd.after(7).save  # the last step saves, never pauses
    pre = odd.after(1, preempt=True)
    assert (pre.save, pre.check, pre.preempt, pre.log) == (True, True, True, False)


@pytest.mark.parametrize("error,code", [
    (policy.PreemptedError("x"), cli.EXIT_PREEMPTED),
    (policy.TrainingInterrupted("x"), cli.EXIT_PREEMPTED),  # Ctrl-C, a checkpoint written
    (KeyboardInterrupt(), None),        # Ctrl-C with nothing saved: main.py says it, 130
    (policy.NonFiniteError("x"), cli.EXIT_NONFINITE),
    (workdir.WorkdirBusyError("x"), cli.EXIT_BUSY),
    (distributed.DistributedStartError("x"), cli.EXIT_DISTRIBUTED),
    (distributed.PeerStoppedError("x", cli.EXIT_BUSY), cli.EXIT_BUSY),  # the peer's own code
    (workdir.WorkdirError("x"), cli.EXIT_WORKDIR),
    (checkpoints.CheckpointMismatchError("x"), cli.EXIT_CHECKPOINT),
    (checkpoints.RunNotFoundError("x"), cli.EXIT_CONFIG),  # the same code in every tool
    (run_config.ConfigChangedError("x"), cli.EXIT_CONFIG),
    (DatasetNotFoundError("x"), cli.EXIT_CONFIG),
    (ValueError("x"), cli.EXIT_CONFIG),
    (RuntimeError("x"), None),          # a bug: its traceback is shown
    (FileNotFoundError("x"), None),
])
def test_one_table_maps_errors_to_exit_codes(error, code):
    assert cli.exit_code(error) == code


def _bad_input():
    raise ValueError("--batch=0: must be >= 1")


@pytest.mark.parametrize("env", ["", "0", "1"])
def test_normvit_traceback_adds_the_traceback_of_a_known_error(env, monkeypatch, capsys):
    """A tool's known error is one line; with $NORMVIT_TRACEBACK set (a GPU lease's scripts set
    it) its traceback comes before that line, with the same exit code."""
    monkeypatch.setenv(cli.TRACEBACK_ENV, env)
    with pytest.raises(SystemExit) as e, cli.tool_errors("python -m normvit_jax.tool"):
        _bad_input()
    assert e.value.code == cli.EXIT_CONFIG
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "python -m normvit_jax.tool: error: --batch=0: must be >= 1"
    shown = "Traceback (most recent call last):" in err and any("_bad_input" in x for x in err)
    assert shown == (env == "1") and (len(err) == 1) == (env != "1"), err
    try:  # main.py's path: the same rule
        _bad_input()
    except ValueError as raised:
        assert cli._stop(raised) == cli.EXIT_CONFIG
    assert ("Traceback" in capsys.readouterr().err) == (env == "1")


def test_gcs_credentials_checked_offline(tmp_path, monkeypatch):
    """Without google-auth installed the check looks where google.auth.default() would: a key
    file, gcloud's application default credentials, a Cloud VM's DMI name; none -> WorkdirError
    naming the setting and the path. Non-gs:// paths are never checked."""
    monkeypatch.setitem(sys.modules, "google.auth", None)  # as if google-auth were not installed
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", "")
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "gcloud"))
    monkeypatch.setattr(preflight, "GCE_PRODUCT_FILE", str(tmp_path / "product_name"))
    preflight.check_gcs_credentials("/local/path", what="config.init_from")  # not gs://: fine
    with pytest.raises(workdir.WorkdirError, match=r"config.init_from gs://b/w.npz: no Google "
                       r"Cloud credentials found \(GOOGLE_APPLICATION_CREDENTIALS is unset"):
        preflight.check_gcs_credentials("gs://b/w.npz", what="config.init_from")
    (tmp_path / "product_name").write_text("Google Compute Engine\n")
    assert preflight.credentials_problem() is None
    (tmp_path / "product_name").write_text("Standard PC\n")
    key = tmp_path / "key.json"
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(key))
    assert "set to a missing file" in preflight.credentials_problem()
    key.write_text("{}")
    assert preflight.credentials_problem() is None
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", "")
    (tmp_path / "gcloud").mkdir()
    (tmp_path / "gcloud" / "application_default_credentials.json").write_text("{}")
    assert preflight.credentials_problem() is None


def test_a_released_lock_leaves_no_owner_and_a_killed_one_is_named(tmp_path):
    """Every re-run of a run that ended normally (the README's resume, --mode=eval after
    training) logged "Taking over WORKDIR/.lock from pid P ..., which has ended", as after a
    crash; the owner is now cleared on release, so the line means a run that was killed."""
    from unittest import mock

    lock = workdir.WorkdirLock(str(tmp_path))
    said = []
    with mock.patch("absl.logging.info", lambda msg, *a: said.append(msg % a)):
        lock.acquire()
        lock.release()
        assert (tmp_path / ".lock").read_text() == ""
        lock.acquire()  # after a run that released it: nothing to take over
        lock.release()
        (tmp_path / ".lock").write_text("pid 1234567 on host h (since 20260101T000000Z)\n")
        lock.acquire()  # after a run that was killed holding it: named
        lock.release()
    assert said == [f"Taking over {tmp_path}/.lock from pid 1234567 on host h (since "
                    "20260101T000000Z), which has ended."], said


def test_a_start_that_fails_before_writing_anything_leaves_no_workdir(tmp_path):
    """A batch larger than the train split is found when the split is opened, after the workdir
    was made and locked: the failed start left an empty run folder (only .lock), against
    docs/faults.md's 'a failed start leaves nothing to clean up'. A new folder is removed; one the
    user made stays."""
    cfg = tiny_demo_config(batch_size=4096)
    new = tmp_path / "runs" / "new"
    assert cli.run(cfg, str(new)) == cli.EXIT_CONFIG
    assert not new.exists() and (tmp_path / "runs").is_dir()
    mine = tmp_path / "mine"
    mine.mkdir()
    assert cli.run(cfg, str(mine)) == cli.EXIT_CONFIG
    assert mine.is_dir() and os.listdir(mine) == [".lock"]
    assert (mine / ".lock").read_text() == ""  # released: no owner left in it


def test_ctrl_c_while_the_data_opens_releases_the_workdir_lock(tmp_path, monkeypatch):
    """The pipelines open after the lock is taken (among the checks the processes agree on); a
    Ctrl-C there must let the lock go, as the with-block around them did: a notebook's next
    start in the same process would otherwise find its own workdir busy."""
    from normvit_jax import data
    from normvit_jax.train import loop

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(data, "make_pipeline", interrupted)
    wd = str(tmp_path / "wd")
    with pytest.raises(KeyboardInterrupt):
        loop.train_and_evaluate(tiny_demo_config(), wd)
    import fcntl
    with open(os.path.join(wd, workdir.LOCK_NAME)) as f:  # another open file: as another process
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError while the start holds it


def test_the_workdir_records_how_each_start_ended_and_keeps_the_log(tmp_path, monkeypatch, caplog):
    """A finished run and a preempted one left the same empty .lock and the log was stdout only:
    training.log appends each start's lines after a separator, status.json and the last log line
    say how it ended (preempted at step 3, exit 42; then finished at step 6), and a re-run of the
    finished run appends its lines and records it finished again."""
    import json
    import logging

    from normvit_jax import cli, preemption, run_log
    from normvit_jax.train import loop
    caplog.set_level(logging.INFO, logger="absl")  # main.py's verbosity (a test may leave WARNING)
    wd = str(tmp_path / "w")
    c = tiny_demo_config()
    monkeypatch.setattr(preemption, "reached", lambda sigterm, step: step == 3)
    with pytest.raises(loop.PreemptedError):
        loop.train_and_evaluate(c, wd)
    status = json.load(open(os.path.join(wd, run_log.STATUS_NAME)))
    assert (status["state"], status["step"], status["exit_code"]) == ("preempted", 3,
                                                                     cli.EXIT_PREEMPTED)
    assert "interrupted at step 3" in status["message"]
    status_message = status["message"]
    monkeypatch.setattr(preemption, "reached", lambda sigterm, step: False)
    loop.train_and_evaluate(c, wd)
    status = json.load(open(os.path.join(wd, run_log.STATUS_NAME)))
    assert (status["state"], status["step"], status["exit_code"]) == ("finished", 6, 0)
    loop.train_and_evaluate(c, wd)  # complete: nothing trained, the end recorded again
    log = open(os.path.join(wd, run_log.LOG_NAME)).read()
    assert log.count("----- training start at ") == 3
    starts = log.split("----- training start at ")[1:]
    assert "step 2/6: loss" in starts[0] and "Run ended: preempted at step 3 (exit 42)" in starts[0]
    assert starts[0].rstrip().endswith(status_message)
    assert "Resumed from the checkpoint at step 3" in starts[1]
    assert starts[1].rstrip().endswith("Run ended: finished at step 6 (exit 0).")
    assert "already complete" in starts[2] and "Run ended: finished at step 6" in starts[2]
    assert json.load(open(os.path.join(wd, run_log.STATUS_NAME)))["state"] == "finished"
    # --fresh moves the log and the status with the run; the new run starts its own
    loop.train_and_evaluate(c.copy_and_resolve_references(), wd, stop_at=2, fresh=True)
    status = json.load(open(os.path.join(wd, run_log.STATUS_NAME)))
    assert (status["state"], status["step"]) == ("stopped", 2)
    assert open(os.path.join(wd, run_log.LOG_NAME)).read().count("----- training start") == 1


def test_the_end_state_of_a_crashed_start(tmp_path):
    """An unexpected error exits 1 (its traceback): status.json says the same code, with the
    error's first line. (A signal in start-up, which ends the process at once, is
    tests/test_interruptions.py's: a real SIGINT/SIGTERM to main.py, then status.json read.)"""
    from normvit_jax import run_log
    from normvit_jax.train import loop
    log = run_log.RunLog(str(tmp_path))
    loop._record_end(log, RuntimeError("boom\nat line 2"), None)
    status = run_log.read_status(str(tmp_path))
    assert (status["state"], status["exit_code"], status["message"]) == ("failed", 1,
                                                                       "RuntimeError: boom")


class _Exited(BaseException):
    """What a fake os._exit raises in the main thread (the process would have ended)."""


def _fake_exit(monkeypatch) -> list[int]:
    """os._exit replaced: records the code; raises _Exited in the main thread (the signal
    watcher's thread only records, and goes on reading)."""
    import threading
    codes: list[int] = []

    def fake(code):
        codes.append(code)
        if threading.current_thread() is threading.main_thread():
            raise _Exited(code)
    monkeypatch.setattr(os, "_exit", fake)
    return codes


def _ctrl_c(flag=None) -> None:
    """SIGINT to this process, then waits (up to 5 s) for the handler to run: until it raises,
    or sets ``flag.received``."""
    import signal
    import time
    os.kill(os.getpid(), signal.SIGINT)
    deadline = time.time() + 5
    while time.time() < deadline and not (flag is not None and flag.received):
        time.sleep(0.01)


@pytest.mark.parametrize("exit_at_once", [True, False])
def test_ctrl_c_in_start_up_exits_for_the_command_line_and_raises_for_a_library(
        exit_at_once, monkeypatch, capsys):
    """A notebook's "interrupt kernel" during train_and_evaluate's start-up ended the kernel
    (os._exit(130)). main.py (cli.run) asks for that (exit_at_once: one line, exit 130); a
    library caller gets Python's KeyboardInterrupt and the process lives on, handler restored."""
    import signal

    from normvit_jax import preemption
    codes = _fake_exit(monkeypatch)
    before = signal.getsignal(signal.SIGINT)
    ended = []
    with pytest.raises(_Exited if exit_at_once else KeyboardInterrupt) as raised:
        with preemption.SigtermFlag(exit_at_once=exit_at_once) as flag:
            flag.on_abrupt_exit(lambda *a: ended.append(a))
            _ctrl_c()
    for t in threading.enumerate():  # the signal watcher reads the end of its pipe: it is done
        if t.name == "normvit-signal-watch":
            t.join(5)
    assert signal.getsignal(signal.SIGINT) is before
    err = capsys.readouterr().err
    if exit_at_once:
        assert codes and set(codes) == {130} and ended[0][:2] == (None, 130), (codes, ended)
        assert "Ctrl-C while starting up (before the first step): stopped at once" in err
    else:
        assert type(raised.value) is KeyboardInterrupt and not codes and not ended, codes
        assert "starting up" not in err


_DEAF_MAIN_THREAD = """
import signal, sys, time
from normvit_jax import preemption
with preemption.SigtermFlag(exit_at_once=sys.argv[1] == "cli") as flag:
    flag.started()
    flag.step = 7
    # the signals go to the watcher thread, and the main thread runs no Python signal handler
    # for SLEEP_S, as in a C++ call (a held checkpoint commit, a long device step)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    print("deaf", flush=True)
    try:
        time.sleep(float(sys.argv[2]))
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
        time.sleep(0.5)  # the handlers run now (Python's own check after the call returns)
    except KeyboardInterrupt:
        print("KeyboardInterrupt", flush=True)
        sys.exit(3)
print("returned", flush=True)
"""


@pytest.mark.parametrize("caller,signum,code", [
    ("cli", "SIGINT", 130), ("cli", "SIGTERM", 143), ("library", "SIGTERM", 143),
    ("library", "SIGINT", 3)])
def test_a_second_signal_does_not_wait_for_the_main_threads_cxx_call(caller, signum, code):
    """main.py's second Ctrl-C ran in the main thread's Python handler, which waits for the C++
    call it is in to return: a CI run waited 90 s (three held checkpoint commits) for "stopped at
    once". The signal watcher ends it now; a library caller's second Ctrl-C still waits to raise
    KeyboardInterrupt in its own thread (exit 3 here), and its SIGTERM ends the process too."""
    import signal
    import subprocess
    sleep_s = 60 if code != 3 else 3
    p = subprocess.Popen([sys.executable, "-c", _DEAF_MAIN_THREAD, caller, str(sleep_s)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        assert p.stdout.readline() == "deaf\n"
        sig = getattr(signal, signum)
        p.send_signal(sig)
        time.sleep(0.3)
        t = time.time()
        p.send_signal(sig)
        out, err = p.communicate(timeout=sleep_s + 30)
    finally:
        p.kill()
    assert p.returncode == code, (p.returncode, out, err)
    name = "Ctrl-C" if signum == "SIGINT" else signum
    again = f"{name} again: stopped at once, nothing saved since the last checkpoint"
    if code == 3:
        assert "KeyboardInterrupt" in out and again not in err, (out, err)
    else:
        assert time.time() - t < 15, time.time() - t  # not the 60 s of the main thread's call
        assert err.count(again) == 1 and "returned" not in out, (out, err)


@pytest.fixture
def absl_logger_as_before():
    """``abrupt_end`` is followed by ``os._exit`` in a real process, so it leaves its training.log
    handler and ``_attach``'s level and filter on the absl logger; in this test process they
    would outlive the test (a stale filter would keep INFO lines from a later test's caplog)."""
    from absl import logging
    level = logging.get_absl_logger().level
    yield
    detach_run_logs()
    logging.get_absl_logger().setLevel(level)


def test_abrupt_end_before_the_first_step_keeps_the_runs_last_end(tmp_path, absl_logger_as_before):
    """main.py's Ctrl-C during the re-run of a finished run (start-up: os._exit) wrote
    {"state": "preempted", "step": null, "exit_code": 130}: the run's `finished` was lost. It
    stays, with the interrupted start in last_start; a new run's record is as before, and a
    second signal after steps records the step."""
    from normvit_jax import run_log
    wd = str(tmp_path)
    first = run_log.RunLog(wd)
    first.start()
    first.end("finished", 6, 0)
    again = run_log.RunLog(wd)
    again.start()
    again.abrupt_end(None, 130, "Ctrl-C while starting up (before the first step): stopped")
    status = run_log.read_status(wd)
    assert (status["state"], status["step"], status["exit_code"]) == ("finished", 6, 0), status
    assert (status["last_start"]["state"], status["last_start"]["exit_code"]) == ("preempted", 130)
    assert status["last_start"]["message"].startswith("Ctrl-C while starting up")
    log = open(os.path.join(wd, run_log.LOG_NAME)).read().rstrip().splitlines()
    assert log[-2].endswith("Run ended: preempted (exit 130) before its first step; status.json "
                            "still says the run's last end (finished).") and \
        log[-1].strip().startswith("Ctrl-C while starting up"), log[-4:]
    resumed = run_log.RunLog(wd)  # a second signal after a step: that step, as before
    resumed.start()
    resumed.abrupt_end(8, 130, "Ctrl-C again: stopped at once")
    status = run_log.read_status(wd)
    assert (status["state"], status["step"], status["exit_code"]) == ("preempted", 8, 130)
    assert "last_start" not in status
    new = str(tmp_path / "new")
    os.makedirs(new)
    fresh = run_log.RunLog(new)
    fresh.start()
    fresh.abrupt_end(None, 42, "SIGTERM while starting up")
    status = run_log.read_status(new)
    assert (status["state"], status["step"], status["exit_code"]) == ("preempted", None, 42)


def test_a_library_callers_ctrl_c_while_rerunning_a_finished_run(tmp_path, monkeypatch):
    """In a notebook, Ctrl-C while re-running a finished run (all start-up: no step to train)
    killed the kernel and left status.json `preempted` at no step. Now the caller gets a
    KeyboardInterrupt, status.json still says `finished` (the interrupted start in
    last_start), and the next call in the same process works."""
    import json
    import signal

    from normvit_jax import run_log
    from normvit_jax.train import build, loop
    wd = str(tmp_path / "w")
    c = tiny_demo_config(total_steps=2, eval_every=2, checkpoint_every=2)
    assert loop.train_and_evaluate(c, wd)["step"] == 2
    codes = _fake_exit(monkeypatch)
    real_build = build.build_run

    def interrupted(*args, **kwargs):
        _ctrl_c()
        return real_build(*args, **kwargs)
    monkeypatch.setattr(build, "build_run", interrupted)
    handler = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt) as raised:
        loop.train_and_evaluate(c, wd)
    assert type(raised.value) is KeyboardInterrupt and not codes, codes
    assert signal.getsignal(signal.SIGINT) is handler
    status = json.load(open(os.path.join(wd, run_log.STATUS_NAME)))
    assert (status["state"], status["step"], status["exit_code"]) == ("finished", 2, 0), status
    assert (status["last_start"]["state"], status["last_start"]["exit_code"]) == \
        ("preempted", cli.EXIT_INTERRUPTED)
    monkeypatch.setattr(build, "build_run", real_build)
    assert loop.train_and_evaluate(c, wd)["step"] == 2  # the process and the workdir still work
    assert run_log.read_status(wd)["state"] == "finished"


def test_ctrl_c_in_training_ends_a_sweep_that_catches_exception(tmp_path, monkeypatch):
    """`for norm in ...: try: train_and_evaluate(...) except Exception: continue` swallowed the
    user's Ctrl-C (a PreemptedError, a RuntimeError) and trained the next model. Ctrl-C's error,
    TrainingInterrupted, is a KeyboardInterrupt, not an Exception: the loop ends, after the
    checkpoint; status.json and the exit code (cli.run: 42) as for SIGTERM's PreemptedError."""
    from normvit_jax import preemption, run_log
    from normvit_jax.train import loop
    real_reached = preemption.reached

    def ctrl_c_at_step_1(flag, step):
        if step == 1 and not flag.received:
            _ctrl_c(flag)
        return real_reached(flag, step)
    monkeypatch.setattr(preemption, "reached", ctrl_c_at_step_1)
    ran = []
    with pytest.raises(loop.TrainingInterrupted) as raised:
        for norm in ("layernorm", "rmsnorm"):
            try:
                ran.append(norm)
                loop.train_and_evaluate(tiny_demo_config(**{"model.norm.name": norm}),
                                        str(tmp_path / norm))
            except Exception:  # noqa: BLE001  (the sweep's own: a failed model, the next one)
                continue
    assert ran == ["layernorm"]
    error = raised.value
    assert isinstance(error, KeyboardInterrupt) and not isinstance(error, Exception)
    assert str(error).startswith("interrupted at step 1; saved in ")
    assert cli.exit_code(error) == cli.EXIT_PREEMPTED
    wd = str(tmp_path / "layernorm")
    assert checkpoints.complete_steps(wd) == [1]
    status = run_log.read_status(wd)
    assert (status["state"], status["step"], status["exit_code"]) == ("preempted", 1, 42), status
    # main.py's path: the same Ctrl-C is one line and exit 42, as before
    assert cli.run(tiny_demo_config(total_steps=2), str(tmp_path / "cli")) == cli.EXIT_PREEMPTED
    assert checkpoints.complete_steps(str(tmp_path / "cli")) == [1]
