"""A real multi-process run on this machine: two JAX processes on localhost joined by
``jax.distributed.initialize`` (gloo collectives on the CPU backend, 2 CPU devices each), started
through ``launch/local.sh`` as a user would, one of them killed, the job restarted, and the result
compared with one process on 4 devices with the same global batch (tests/multiproc_config.py:
24 steps, checkpoints every 4, evals at 12 and 24).

1. Once the first checkpoint is complete, process 1 gets SIGTERM and, 0.3 s later, SIGKILL (a
   scheduler whose grace is too short). Process 0 is then stuck in a collective or in the
   preemption checkpoint; local.sh SIGKILLs it after its grace, as srun --kill-on-bad-exit does.
   If both finished the preemption checkpoint within the 0.3 s they exit 42 instead: either way
   the newest complete checkpoint r is where the restart begins.
2. Restarted (both processes): resumes at r and runs to the end.

Checked: the final train state equals the one-process run's (tolerance at the assertion: not
bitwise, gloo's ring all-reduce adds the 4 devices' gradients in another order), each process read
exactly its half of every global batch, and every eval counted each of the 100 examples exactly
once across the processes. About 2 minutes on 2 idle cores, most of it starting JAX and TensorFlow
5 times.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import types

import jax
import numpy as np
import pytest

from normvit_jax import checkpoints, cli, summaries
from tests.conftest import REPO_ROOT, compile_cache_env
from tests.deploy_runs import XLA_FAST

CONFIG = "tests/multiproc_config.py"
STEPS, EVAL_EXAMPLES, EVAL_BATCHES, GLOBAL_BATCH = 24, 100, 4, 16
TIMEOUT = 300

def _env(tmp_path, **extra: str) -> dict:
    """Every process with XLA's backend optimizations off (tests/deploy_runs.XLA_FAST: compiles
    3-6x faster; the runs compared are compiled alike); local.sh appends its device count."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID",
                        "XLA_FLAGS", "JAX_PLATFORMS")}
    env["XLA_FLAGS"] = XLA_FAST
    env.update(PYTHONPATH=REPO_ROOT, TF_CPP_MIN_LOG_LEVEL="2", ENTRY="tests/fault_main.py",
               **compile_cache_env(tmp_path / "jax_cache"), **extra)
    return env


class Job:
    """``launch/local.sh --processes=2 --cpu-devices=2`` with per-process log files."""

    def __init__(self, tmp_path, name: str, workdir, config: str = CONFIG, flags: tuple = (),
                 grace: int = 3, **env: str):
        self.logs = tmp_path / name
        self.logs.mkdir()
        self.stderr = open(self.logs / "local.err", "w")
        self.p = subprocess.Popen(
            ["bash", "launch/local.sh", "--processes=2", "--cpu-devices=2", f"--grace={grace}",
             f"--log-dir={self.logs}", config, str(workdir), *flags],
            cwd=REPO_ROOT, env=_env(tmp_path, **env), stdout=subprocess.DEVNULL,
            stderr=self.stderr)

    def log(self, i: int) -> str:
        path = self.logs / f"process_{i}.log"
        return path.read_text() if path.exists() else ""

    def wait_for(self, i: int, pattern: str) -> re.Match:
        deadline = time.time() + TIMEOUT
        while time.time() < deadline:
            if m := re.search(pattern, self.log(i)):
                return m
            assert self.p.poll() is None, f"job ended ({self.p.returncode}):\n{self.tails()}"
            time.sleep(0.1)
        raise AssertionError(f"no {pattern!r} from process {i}:\n{self.tails()}")

    def pid(self, i: int) -> int:
        if not self.stderr.closed:
            self.stderr.flush()
        text = (self.logs / "local.err").read_text()
        return int(re.search(rf"process {i} of 2: pid (\d+)", text).group(1))

    def finish(self) -> int:
        try:
            return self.p.wait(TIMEOUT)
        finally:
            self.stderr.close()

    def close(self) -> None:  # contextlib.closing: a failed check leaves no process behind
        self.kill()

    def tails(self) -> str:
        return "\n".join(f"--- process {i}:\n{self.log(i)[-3000:]}" for i in range(2)) + (
            f"\n--- local.sh:\n{(self.logs / 'local.err').read_text()}")

    def kill(self) -> None:
        """After a failed check: SIGKILL the processes (a hung one may ignore SIGTERM: JAX's
        preemption notifier takes it), then local.sh."""
        if self.p.poll() is None:
            for i in range(2):
                with contextlib.suppress(Exception):  # no pid yet, or already gone
                    os.kill(self.pid(i), signal.SIGKILL)
            self.p.send_signal(signal.SIGTERM)  # local.sh forwards it
            try:
                self.p.wait(30)
            except subprocess.TimeoutExpired:
                self.p.kill()


def read_record(path) -> list[list[int]]:
    with open(path) as f:
        return [list(map(int, line.split())) for line in f]


def assert_state_close(a: dict, b: dict) -> None:
    """Integer leaves equal; float leaves within 2e-5 of the leaf's largest magnitude.

    Why not bitwise: one process sums the 4 devices' gradients in device order ((0+1)+2)+3; gloo's
    ring all-reduce sums each quarter of the vector starting at a different device (measured on
    jax 0.10.2: about 1/3 of float32 sums differ in the last bit). Over 24 Adam steps that grows to
    4e-6 of a leaf's scale (value kernel, the largest seen); with jax 0.11.2 (Python 3.12) to
    4.6e-5 (one of the 16 elements of the final norm's bias in tests/test_own_data.py), so the
    bound is 1e-4 of the scale: a wrong shard or a step taken twice moves leaves by far more. Excluded: the attention key bias, whose
    gradient is 0 in exact arithmetic (softmax ignores a shift shared by all keys): both runs hold
    Adam-normalised rounding noise there, so only its smallness is checked."""
    la, ta = jax.tree_util.tree_flatten_with_path(a)
    lb, tb = jax.tree_util.tree_flatten_with_path(b)
    assert ta == tb
    for (path, x), (_, y) in zip(la, lb):
        name = jax.tree_util.keystr(path)
        x, y = np.asarray(x), np.asarray(y)
        assert x.shape == y.shape and x.dtype == y.dtype, name
        if not np.issubdtype(x.dtype, np.floating):
            np.testing.assert_array_equal(x, y, err_msg=name)
        elif "['key']['bias']" in name:
            assert np.abs(x).max() < 1e-3 and np.abs(y).max() < 1e-3, name
        else:
            scale = float(np.abs(y).max())
            np.testing.assert_allclose(x, y, rtol=0, atol=1e-4 * scale + 1e-30, err_msg=name)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process on 4 CPU devices with the same global batch of 16, all STEPS steps (evals at
    12 and 24; checkpoints 16, 20 and 24 kept), the indices of its train batches recorded: the run
    the killed and restarted two-process job must end like, and the run the eval-mode and
    damaged-checkpoint tests continue with two processes (each on its own copy: ``copy(dst)``)."""
    tmp = tmp_path_factory.mktemp("reference")
    wd = tmp / "ref"
    r = subprocess.run(
        [sys.executable, "tests/fault_main.py", f"--config={CONFIG}", f"--workdir={wd}"],
        cwd=REPO_ROOT, env=_env(tmp, JAX_PLATFORMS="cpu",
                                NORMVIT_TEST_RECORD=str(tmp / "ref.train.{process}"),
                                XLA_FLAGS=XLA_FAST + " --xla_force_host_platform_device_count=4"),
        capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == cli.EXIT_OK, (r.stdout + r.stderr)[-5000:]
    return types.SimpleNamespace(workdir=wd, rows=read_record(tmp / "ref.train.0"),
                                 copy=lambda dst: shutil.copytree(wd, dst))


@pytest.mark.multiprocess
def test_two_processes_killed_and_restarted_end_like_one(reference, tmp_path):
    wd = tmp_path / "run"
    rec = lambda phase, kind="train": str(tmp_path / f"{phase}.{kind}.{{process}}")  # noqa: E731
    t0 = time.time()
    jobs: list[Job] = []
    try:
        # 1. process 1 killed (SIGTERM, then SIGKILL) once a checkpoint exists
        first = Job(tmp_path, "first", wd, NORMVIT_TEST_RECORD=rec("first"))
        jobs.append(first)
        first.wait_for(1, r"Model: ")
        deadline = time.time() + TIMEOUT
        while not checkpoints.complete_steps(str(wd)):
            assert time.time() < deadline and first.p.poll() is None, first.tails()
            time.sleep(0.05)
        os.kill(first.pid(1), signal.SIGTERM)
        time.sleep(0.3)
        try:
            os.kill(first.pid(1), signal.SIGKILL)
        except ProcessLookupError:
            pass  # it had already checkpointed and exited
        rc = first.finish()
        assert rc in (128 + signal.SIGKILL, cli.EXIT_PREEMPTED), first.tails()
        r = max(checkpoints.complete_steps(str(wd)))
        assert 4 <= r < STEPS, r
        t1 = time.time()

        # 2. restarted: resumes at r and runs to the end
        second = Job(tmp_path, "second", wd, NORMVIT_TEST_RECORD=rec("second"),
                     NORMVIT_TEST_RECORD_EVAL=rec("second", "eval"))
        jobs.append(second)
        assert second.finish() == cli.EXIT_OK, second.tails()
        for i in range(2):
            assert re.search(rf"Resumed from the checkpoint at step {r} in ", second.log(i))
            assert re.search(rf"Done at step {STEPS}", second.log(i))
        t2 = time.time()
    finally:
        for job in jobs:
            job.kill()
    print(f"killed job {t1 - t0:.0f} s (exit {rc}, resumed at {r}), restarted job {t2 - t1:.0f} s")

    a, _ = checkpoints.load_state(str(wd), STEPS)
    b, _ = checkpoints.load_state(str(reference.workdir), STEPS)
    assert_state_close(a, b)

    # data: process i read rows [8i, 8i + 8) of every global batch and nothing else
    ref_rows = reference.rows
    assert len(ref_rows) == STEPS and all(len(row) == GLOBAL_BATCH for row in ref_rows)
    half = GLOBAL_BATCH // 2
    for i in range(2):
        first_rows = read_record(tmp_path / f"first.train.{i}")
        assert len(first_rows) >= r  # the killed job may have gone past its last checkpoint
        assert first_rows[:r] == [row[i * half:(i + 1) * half] for row in ref_rows[:r]]
        assert read_record(tmp_path / f"second.train.{i}") == [
            row[i * half:(i + 1) * half] for row in ref_rows[r:]]

    # eval (steps 12 and 24 in the restarted job, or 24 only if r >= 12): each pass counts each
    # of the 100 examples exactly once over the two processes
    passes = [read_record(tmp_path / f"second.eval.{i}") for i in range(2)]
    n_passes = len(passes[0]) // EVAL_BATCHES
    assert n_passes == (2 if r < 12 else 1) and len(passes[1]) == len(passes[0])
    for k in range(n_passes):
        seen = [x for proc in passes for line in proc[k * EVAL_BATCHES:(k + 1) * EVAL_BATCHES]
                for x in line]
        assert sorted(seen) == list(range(EVAL_EXAMPLES))
    counts = summaries.read_scalars(str(wd), include_timing=False)["eval/num_examples"]
    assert {s: v for s, v, _ in counts} == {12: EVAL_EXAMPLES, STEPS: EVAL_EXAMPLES}


@pytest.mark.multiprocess
def test_a_start_check_failing_on_one_process_stops_both_with_its_reason(tmp_path):
    """Process 1's dataset is missing (its config names one its host lacks): it stops with exit 2
    and process 0, which passed its checks and holds the workdir lock, stops too, at once, with
    process 1's reason and exit code in one line. Before, process 0 waited in the barrier after
    the checks until gloo's 30 s timeout ended it with a traceback and exit 1 (the launcher's
    exit code), the reason only in process 1's log."""
    # grace 20 s (< gloo's 30 s): on a loaded CI runner process 0 once took over 3 s to end after
    # its one-line stop (JAX's distributed shutdown at exit), and local.sh SIGKILLed it
    job = Job(tmp_path, "job", tmp_path / "run", "tests/multiproc_host1_missing_config.py",
              grace=20)
    with contextlib.closing(job):
        assert job.finish() == cli.EXIT_CONFIG, job.tails()
    assert sorted(re.findall(r"process (\d) exited with 2$", (job.logs / "local.err").read_text(),
                             re.M)) == ["0", "1"], job.tails()
    for i in range(2):
        assert "Traceback" not in job.log(i) and "only_on_host_0" in job.log(i), job.tails()
    assert re.search(r"Stopped: process 1 of 2 stopped during the start's checks \(exit 2\), so "
                     r"every process stops: config.data.name='only_on_host_0' is not a known "
                     r"dataset", job.log(0)), job.tails()
    assert not (tmp_path / "run" / "checkpoints").exists()  # nothing trained or saved


@pytest.mark.multiprocess
def test_eval_mode_on_two_processes_splits_the_split_and_matches_one(reference, tmp_path):
    """``--mode=eval`` through local.sh joins the processes as training does: each process reads
    its half of every eval batch (each of the 100 examples once over both), and the metrics are
    the one-process run's own eval at the same step. It used to skip jax.distributed: every
    process evaluated the whole split alone, on every device it saw (under srun: all GPUs of its
    node), and each wrote the result file. Then a check failing on process 1 only stops both
    with its line (process 0 used to wait in the restore until gloo's timeout, a traceback)."""
    wd, steps = tmp_path / "run", STEPS
    reference.copy(wd)  # 4 devices; evaluated at the end
    job = Job(tmp_path, "eval", wd, flags=(f"--config.total_steps={steps}", "--mode=eval"),
              NORMVIT_TEST_RECORD_EVAL=str(tmp_path / "eval.{process}"))
    with contextlib.closing(job):
        assert job.finish() == cli.EXIT_OK, job.tails()
    rows = [read_record(tmp_path / f"eval.{i}") for i in range(2)]
    assert len(rows[0]) == len(rows[1]) == EVAL_BATCHES, job.tails()
    assert sorted(x for proc in rows for line in proc for x in line) == list(range(EVAL_EXAMPLES))
    with open(wd / f"eval_digits_test_{steps}.json") as f:
        saved = json.load(f)
    got = saved["metrics"]
    # the per-class counts, summed over both processes' halves: each example once
    pc = saved["per_class"]
    assert sum(pc["examples"]) == EVAL_EXAMPLES == sum(map(sum, pc["confusion"]))
    assert sum(pc["confusion"][i][i] for i in range(10)) == round(got["top1"] * EVAL_EXAMPLES)
    printed = [[line for line in job.log(i).splitlines() if line.startswith("{")] for i in range(2)]
    assert len(printed[0]) == 1 and printed[1] == [], printed  # one JSON answer: process 0's
    assert json.loads(printed[0][0])["metrics"] == got
    # a check failing on process 1 only (its dataset missing) stops both at once with its line
    # (the processes agree before any collective; before, process 0 waited in the restore)
    job = Job(tmp_path, "eval_host1_missing", wd, "tests/multiproc_host1_missing_config.py",
              flags=(f"--config.total_steps={steps}", "--mode=eval"))
    with contextlib.closing(job):
        assert job.finish() == cli.EXIT_CONFIG, job.tails()
    # (process 1's config names a dataset its run did not train on: run_config.check_eval_dataset)
    assert re.search(r"Stopped: process 1 of 2 stopped during the evaluation's checks \(exit 2\)"
                     r", so every process stops: the run in \S+ trained on dataset 'digits'; this "
                     r"config names 'only_on_host_0'", job.log(0)), job.tails()
    assert "Traceback" not in job.log(0) + job.log(1), job.tails()
    scalars = summaries.read_scalars(str(wd), include_timing=False)
    want = {k: next(v for s, v, _ in scalars[f"eval/{k}"] if s == steps)
            for k in ("num_examples", "top1", "top5", "loss")}
    assert got["num_examples"] == want["num_examples"] == EVAL_EXAMPLES
    for k in ("top1", "top5", "loss"):  # loss: the devices' sums added in another order
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, err_msg=k)


@pytest.mark.multiprocess
def test_damaged_newest_checkpoint_moved_once_and_both_processes_resume(reference, tmp_path):
    """A run (one process, 4 devices) whose newest checkpoint (step 24) is damaged, resumed by 2
    processes: process 0 moves it to damaged_checkpoints/ once, both resume from step 20 and
    redo steps 21-24 to the state the run had. Every process used to move it: the first rename
    won, the other process failed with FileNotFoundError (a traceback, exit 1) and the winner
    waited for it in a collective until gloo's timeout."""
    from tests.test_interruptions import scramble
    wd, steps = tmp_path / "run", STEPS
    reference.copy(wd)
    assert checkpoints.complete_steps(str(wd)) == [16, 20, steps]
    reference, _ = checkpoints.load_state(str(wd), steps)
    scramble(wd / "checkpoints" / str(steps))

    job = Job(tmp_path, "resume", wd, flags=(f"--config.total_steps={steps}",))
    with contextlib.closing(job):
        assert job.finish() == cli.EXIT_OK, job.tails()
    for i in range(2):
        log = job.log(i)
        assert "Traceback" not in log, job.tails()
        assert re.search(rf"Checkpoint at step {steps} in \S+ is damaged \(.+\); moved to \S+"
                         rf"damaged_checkpoints.* using step 20 instead", log), job.tails()
        assert re.search(rf"Done at step {steps}", log), job.tails()
    assert sorted(os.listdir(wd / "damaged_checkpoints")) == [str(steps)]  # moved once
    assert checkpoints.complete_steps(str(wd)) == [16, 20, steps]
    assert_state_close(checkpoints.load_state(str(wd), steps)[0], reference)


def _python_with_a_private_workdir(tmp_path, wd) -> str | None:
    """A PYTHON for local.sh under which process 1 sees its own empty tmpfs at ``wd`` (as a
    node-local disk of another host would be); None where mount namespaces are not allowed."""
    if shutil.which("unshare") is None:
        return None
    flags = "-m" if os.geteuid() == 0 else "-r -m"  # unprivileged: a user namespace too
    probe = subprocess.run(f"unshare {flags} mount -t tmpfs none {shlex.quote(str(tmp_path))}",
                           shell=True, capture_output=True)
    if probe.returncode != 0:
        return None
    script = tmp_path / "python.sh"
    script.write_text(
        "#!/bin/bash\n"
        'if [ "$JAX_PROCESS_ID" = 1 ]; then\n'
        f"  exec unshare {flags} bash -c 'mount -t tmpfs none \"$0\" && exec \"$@\"' "
        f'{shlex.quote(str(wd))} {shlex.quote(sys.executable)} "$@"\n'
        "fi\n"
        f'exec {shlex.quote(sys.executable)} "$@"\n')
    script.chmod(0o755)
    return str(script)


@pytest.mark.multiprocess
def test_a_workdir_that_one_process_does_not_see_stops_both_at_once(tmp_path):
    """Process 1 has its own empty folder at the workdir's path (a disk of its own node, here a
    tmpfs in its own mount namespace): both stop at start with exit 5 and a line saying so.
    Before, both trained and then waited in Orbax's first checkpoint, silently, for a folder
    only process 0's disk had (no checkpoint ever complete)."""
    wd = tmp_path / "run"
    wd.mkdir()
    python = _python_with_a_private_workdir(tmp_path, wd)
    if python is None:
        pytest.skip("no mount namespaces here (unshare -m)")
    job = Job(tmp_path, "job", wd, flags=("--config.total_steps=8",), PYTHON=python,
              NORMVIT_TEST_WORKDIR_WAIT_S="2")  # process 1 looks for 2 s, not 10
    with contextlib.closing(job):
        assert job.finish() == cli.EXIT_WORKDIR, job.tails()
    for i in range(2):
        assert "Traceback" not in job.log(i) and "Model:" not in job.log(i), job.tails()
    assert re.search(r"Stopped: process 1 does not see the workdir \S+ that process 0 writes "
                     r"\(on host .+\): every process must use one folder", job.log(1)), job.tails()
    assert re.search(r"Stopped: process 1 of 2 stopped during checking that every process sees "
                     r"the workdir \(exit 5\), so every process stops: process 1 does not see",
                     job.log(0)), job.tails()
    assert not [p for p in os.listdir(wd) if p.startswith(".shared_probe")]  # process 0 cleaned up
