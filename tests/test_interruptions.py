"""Issue 28, points 2 and 3, as a user meets them: Ctrl-C, a second Ctrl-C, a damaged checkpoint
(training and --mode=eval) and a full disk. Each runs ``main.py`` as typed, checks the exit code,
that the output holds the one line and no traceback, and that nothing was lost (bitwise against
one uninterrupted run of tests/fault_config.py, shared by the module)."""
from __future__ import annotations

import glob
import json
import os
import random
import re
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

from normvit_jax import checkpoints, cli
from tests.conftest import REPO_ROOT, compile_cache_env
from tests.deploy_runs import XLA_FAST

CONFIG, STEPS = "tests/fault_config.py", 24  # checkpoints every 5, logs every 2
TIMEOUT = 600


class Run:
    """main.py (or tests/fault_main.py) in a subprocess, its merged output read line by line."""

    def __init__(self, env: dict, workdir, *flags: str, instrumented: bool = False):
        script = "tests/fault_main.py" if instrumented else "main.py"
        self.workdir = workdir
        self.p = subprocess.Popen([sys.executable, script, f"--config={CONFIG}",
                                   f"--workdir={workdir}", *flags], cwd=REPO_ROOT, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.p.stdout),
                                        daemon=True)
        self._reader.start()

    def wait_for(self, pattern: str) -> None:
        deadline = time.time() + TIMEOUT
        while not any(re.search(pattern, line) for line in list(self.lines)):
            assert self.p.poll() is None and time.time() < deadline, \
                f"no {pattern!r} (exit {self.p.poll()}):\n" + "".join(self.lines[-30:])
            time.sleep(0.01)

    def finish(self) -> tuple[int, str]:
        rc = self.p.wait(TIMEOUT)
        self._reader.join(TIMEOUT)
        return rc, "".join(self.lines)


def one_line(out: str, pattern: str) -> str:
    """The output has exactly one line matching ``pattern`` and no traceback."""
    hits = [line for line in out.splitlines() if re.search(pattern, line)]
    assert len(hits) == 1, f"{len(hits)} lines match {pattern!r}:\n{out[-4000:]}"
    assert "Traceback" not in out and "Event loop is closed" not in out, out[-4000:]
    return hits[0]


def assert_same_state(workdir_a, workdir_b, step: int = STEPS) -> None:
    a, _ = checkpoints.load_state(str(workdir_a), step)
    b, _ = checkpoints.load_state(str(workdir_b), step)
    (la, ta), (lb, tb) = jax.tree.flatten(a), jax.tree.flatten(b)
    assert ta == tb
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(x, y)


def scramble(step_dir) -> None:
    """Random bytes over the checkpoint's array data (OCDBT data files), sizes unchanged."""
    rng = random.Random(0)
    files = [p for p in glob.glob(os.path.join(step_dir, "state", "**", "d", "*"), recursive=True)
             if os.path.isfile(p)]
    assert files
    for p in files:
        with open(p, "r+b") as f:
            f.write(bytes(rng.randrange(256) for _ in range(os.path.getsize(p))))


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict:
    e = {**os.environ, "PYTHONPATH": REPO_ROOT, "TF_CPP_MIN_LOG_LEVEL": "2",
         **compile_cache_env(tmp_path_factory.mktemp("jax_cache"))}
    for key in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        e.pop(key, None)
    e["XLA_FLAGS"] = XLA_FAST  # every run compiled alike, 3-6x faster (tests/deploy_runs.py)
    return e


@pytest.fixture(scope="module")
def reference_started(env, tmp_path_factory):
    """The uninterrupted run, started (the first test runs its own beside it)."""
    run = Run(env, tmp_path_factory.mktemp("reference") / "run")
    yield run
    if run.p.poll() is None:
        run.p.kill()
        run.finish()


@pytest.fixture(scope="module")
def reference(reference_started):
    """One uninterrupted run: checkpoints 15, 20, 24."""
    wd = reference_started.workdir
    rc, out = reference_started.finish()
    assert rc == cli.EXIT_OK, out[-4000:]
    assert checkpoints.complete_steps(wd) == [15, 20, 24]
    return wd


def copy(reference, dest) -> str:
    shutil.copytree(reference, dest, ignore=shutil.ignore_patterns(".lock"))
    return str(dest)


def test_ctrl_c_saves_one_line_exit_42_and_resumes_bit_identical(env, reference_started, request,
                                                                 tmp_path):
    wd = tmp_path / "run"  # run while the reference runs
    run = Run(env, wd)
    run.wait_for(rf"step 4/{STEPS}:")
    run.p.send_signal(signal.SIGINT)
    rc, out = run.finish()
    assert rc == cli.EXIT_PREEMPTED, out[-4000:]
    line = one_line(out, r"interrupted at step \d+; saved in \S+; rerun the same command to resume")
    step = int(re.search(r"interrupted at step (\d+)", line).group(1))
    assert 4 <= step < STEPS and max(checkpoints.complete_steps(wd)) == step
    rc, out = Run(env, wd).finish()  # the same command again
    assert rc == cli.EXIT_OK and f"Resumed from the checkpoint at step {step} " in out, out[-4000:]
    assert_same_state(request.getfixturevalue("reference"), wd)


def test_ctrl_c_of_a_fresh_run_says_to_rerun_without_fresh(env, reference, tmp_path):
    """A run started with --fresh (over an old run) and stopped by Ctrl-C: its line said 'rerun the
    same command', which with --fresh moved the new checkpoint aside and started over at step 0
    (a requeued job never got further). It says to rerun without --fresh, which resumes."""
    wd = copy(reference, tmp_path / "run")
    run = Run(env, wd, "--fresh")
    run.wait_for(rf"step 4/{STEPS}:")
    run.p.send_signal(signal.SIGINT)
    rc, out = run.finish()
    assert rc == cli.EXIT_PREEMPTED, out[-4000:]
    line = one_line(out, r"interrupted at step \d+; saved in \S+; rerun the same command without "
                         r"--fresh to resume$")
    step = int(re.search(r"interrupted at step (\d+)", line).group(1))
    rc, out = Run(env, wd).finish()  # as told
    assert rc == cli.EXIT_OK and f"Resumed from the checkpoint at step {step} " in out, out[-4000:]
    assert len(os.listdir(os.path.join(wd, "replaced"))) == 1  # the old run only; nothing moved now
    assert_same_state(reference, wd)


def test_ctrl_c_or_sigterm_while_starting_up_stops_at_once_in_one_line(env, tmp_path):
    """Issue 35, item 4: before the first step there is nothing to save. The signal comes when the
    model is built (the log's 'Model:' line), just before the restore and the train step's
    compilation, which is C++ where a Python handler would wait for it: exit within seconds."""
    for sig, code, name in ((signal.SIGINT, 130, "Ctrl-C"), (signal.SIGTERM, cli.EXIT_PREEMPTED,
                                                            "SIGTERM")):
        run = Run(env, tmp_path / name)
        run.wait_for(r"Model: ViT")
        t = time.time()
        run.p.send_signal(sig)
        rc, out = run.finish()
        assert rc == code and time.time() - t < 5, (rc, time.time() - t, out[-4000:])
        one_line(out, rf"^{name} while starting up \(before the first step\): stopped at once; "
                      r"nothing new to save; rerun the same command to start again\.$")
        assert not re.search(r"step \d+/", out) and not checkpoints.complete_steps(tmp_path / name)
        assert_recorded_end(tmp_path / name, (None,), code, f"{name} while starting up")


def assert_recorded_end(wd, steps, code: int, message: str) -> None:
    """status.json and training.log's last line record the end of a process a signal ended at
    once (os._exit: they said 'running' and had no 'Run ended' line)."""
    from normvit_jax import run_log
    status = run_log.read_status(str(wd))
    assert (status["state"], status["exit_code"]) == ("preempted", code) and \
        status["step"] in steps, status
    step = status["step"]
    assert status["message"].startswith(message), status
    log = open(os.path.join(wd, run_log.LOG_NAME)).read().rstrip().splitlines()
    where = "" if step is None else f" at step {step}"
    assert log[-2].endswith(f"Run ended: preempted{where} (exit {code}).") and \
        log[-1].strip().startswith(message), log[-5:]


def test_second_ctrl_c_stops_at_once_and_keeps_the_checkpoints(env, reference, tmp_path):
    """Every checkpoint commit is held 30 s (tests/fault_main.py), so the second Ctrl-C comes
    while the run waits to save: it ends at once, the complete checkpoints are untouched."""
    wd = copy(reference, tmp_path / "run")
    run = Run({**env, "NORMVIT_TEST_HOLD_COMMIT": "30"}, wd, "--config.total_steps=30",
              "--config.allow_config_change=True", instrumented=True)
    run.wait_for(r"step 26/30:")  # the checkpoint of step 25 is being held
    run.p.send_signal(signal.SIGINT)
    run.wait_for("Ctrl-C received: finishing this step")
    t = time.time()
    run.p.send_signal(signal.SIGINT)
    rc, out = run.finish()
    assert rc == 128 + signal.SIGINT and time.time() - t < 20, out[-4000:]
    one_line(out, r"^Ctrl-C again: stopped at once, nothing saved since the last checkpoint; "
                  r"rerun the same command to resume from it\.$")
    assert checkpoints.complete_steps(wd) == [15, 20, 24]
    assert_recorded_end(wd, range(26, 31), 128 + signal.SIGINT, "Ctrl-C again: stopped at once")
    assert_same_state(reference, wd)


def test_damaged_newest_checkpoint_one_warning_and_fallback_in_train_and_eval(env, reference,
                                                                               tmp_path):
    train_wd, eval_wd = copy(reference, tmp_path / "train"), copy(reference, tmp_path / "eval")
    for wd in (train_wd, eval_wd):
        scramble(os.path.join(wd, "checkpoints", "24"))
    damaged = (r"Checkpoint at step 24 in \S+ is damaged \(.+\)%s; "
               r"using step 20 instead\.")

    evaluated, trained = Run(env, eval_wd, "--mode=eval"), Run(env, train_wd)  # at once
    rc, out = evaluated.finish()
    assert rc == cli.EXIT_OK, out[-4000:]
    one_line(out, damaged % "")
    result = json.loads(out.strip().splitlines()[-1])
    assert result["step"] == 20 and os.path.exists(result["path"])
    one_line(out, r"eval of step 20 on digits:test")
    assert checkpoints.complete_steps(eval_wd) == [15, 20, 24]  # eval moves nothing

    rc, out = trained.finish()  # the run's own command again: redoes steps 21-24
    assert rc == cli.EXIT_OK, out[-4000:]
    one_line(out, damaged % r"; moved to \S+damaged_checkpoints/24")
    assert len(out.splitlines()) < 20, out
    assert_same_state(reference, train_wd)

    for s in (15, 20):  # now none is readable: one line, exit 4, nothing moved
        scramble(os.path.join(eval_wd, "checkpoints", str(s)))
    rc, out = Run(env, eval_wd, "--mode=eval").finish()
    assert rc == cli.EXIT_CHECKPOINT, out[-4000:]
    one_line(out, r"Stopped: no checkpoint in \S+ restores: step 24: .*; step 20: .*; step 15: .*"
                  r"Nothing was moved or deleted\.$")
    assert checkpoints.complete_steps(eval_wd) == [15, 20, 24]


def test_disk_full_is_one_line_and_keeps_the_newest_checkpoint(env, reference, tmp_path):
    """Files may not grow past 16 kB (as on a full disk) while the run goes on to step 27: the
    checkpoint of step 25 fails; one line, exit 5, no asyncio noise; step 24 is intact."""
    wd = copy(reference, tmp_path / "run")
    run = Run(env, wd, "--config.total_steps=27", "--config.allow_config_change=True")
    resource.prlimit(run.p.pid, resource.RLIMIT_FSIZE, (16_000, 16_000))  # Python ignores SIGXFSZ
    rc, out = run.finish()
    assert rc == cli.EXIT_WORKDIR, out[-4000:]
    one_line(out, r"Stopped: writing the checkpoint of step 25 to \S+ failed \(.*File too large.*\); "
                  r"the newest complete checkpoint \(step 24\) is kept")
    assert len(out.splitlines()) < 20, out
    assert checkpoints.complete_steps(wd) == [15, 20, 24]
    assert_same_state(reference, wd)
