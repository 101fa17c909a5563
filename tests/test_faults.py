"""Faults injected into real runs of main.py in subprocesses (tests/fault_config.py: a one-block
tiny ViT on the digits, 24 steps, checkpoints every 5, logs every 2), each asserting the exit code,
the message and that nothing was lost: the faulted run ends equal to one uninterrupted run
(``reference``) in every array of the train state, in its summaries and in its data order.

Most of the time goes into starting JAX and TensorFlow, so: the subprocesses share a JAX
compilation cache, and the runs that need no live interaction (``@early`` launchers, each beside
its test) start in background threads as soon as they can, two heavy ones at a time, while the
interactive tests run.
"""
from __future__ import annotations

import glob
import os
import random
import re
import resource
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from typing import Callable

import jax
import numpy as np
import pytest

from normvit_jax import checkpoints, cli, summaries
from tests.conftest import REPO_ROOT, compile_cache_env
from tests.deploy_runs import XLA_FAST

CONFIG = "tests/fault_config.py"
STEPS = 24
TIMEOUT = 600  # seconds per subprocess: generous, CI machines are shared
_SLOTS = threading.Semaphore(2)  # heavy background runs at once


class Proc:
    """``main.py`` (or tests/fault_main.py, for its instruments) in a subprocess; its merged
    stdout/stderr is collected line by line so a test can act when a line appears."""

    def __init__(self, workdir, *flags: str, env: dict | None = None, instrumented: bool = False,
                 as_plain_user: bool = False, throttled: bool = False):
        self._slot = throttled and _SLOTS.acquire()  # released when the process ends
        script = "tests/fault_main.py" if instrumented else "main.py"
        # As root, permission bits bind only without CAP_DAC_OVERRIDE/CAP_FOWNER: the child
        # drops them from its bounding set, then execs main.py as an ordinary user would run.
        prefix = ["-c", _DROP_FILE_OVERRIDE] if as_plain_user and os.geteuid() == 0 else []
        self.p = subprocess.Popen(
            [sys.executable, *prefix, script, f"--config={CONFIG}", f"--workdir={workdir}", *flags],
            cwd=REPO_ROOT, env={**_ENV, **(env or {})}, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._cv = threading.Condition()
        self._eof = False
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.p.stdout:
            with self._cv:
                self.lines.append(line)
                self._cv.notify_all()
        self.p.wait()
        if self._slot:
            _SLOTS.release()
        with self._cv:
            self._eof = True
            self._cv.notify_all()

    @property
    def output(self) -> str:
        with self._cv:
            return "".join(self.lines)

    def wait_for(self, pattern: str, timeout: float = TIMEOUT) -> re.Match:
        rx, seen, deadline = re.compile(pattern), 0, time.time() + timeout
        with self._cv:
            while True:
                for line in self.lines[seen:]:
                    if m := rx.search(line):
                        return m
                seen = len(self.lines)
                if self._eof or time.time() > deadline:
                    raise AssertionError(f"no line matching {pattern!r} (exit {self.p.poll()}):\n"
                                         + "".join(self.lines[-40:]))
                self._cv.wait(1.0)

    def finish(self, timeout: float = TIMEOUT) -> int:
        rc = self.p.wait(timeout)
        self._reader.join(timeout)
        return rc

    def expect(self, rc: int, *patterns: str) -> None:
        got = self.finish()
        out = self.output
        assert got == rc, f"exit code {got}, expected {rc}:\n{out[-5000:]}"
        for pattern in patterns:
            assert re.search(pattern, out), f"no {pattern!r} in:\n{out[-5000:]}"


_ENV: dict = {}
EXIT_NO_CAPS = 77
_DROP_FILE_OVERRIDE = (  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER; 24: PR_CAPBSET_DROP
    "import ctypes, os, sys\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "if any(libc.prctl(24, cap, 0, 0, 0) for cap in (1, 2, 3)): sys.exit(%d)\n"
    "os.execv(sys.executable, [sys.executable] + sys.argv[1:])\n" % EXIT_NO_CAPS)


@pytest.fixture(scope="module", autouse=True)
def _subprocess_env(tmp_path_factory):
    _ENV.clear()
    _ENV.update(os.environ, PYTHONPATH=REPO_ROOT, TF_CPP_MIN_LOG_LEVEL="2",
                **compile_cache_env(tmp_path_factory.mktemp("jax_cache")))
    for key in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        _ENV.pop(key, None)
    _ENV["XLA_FLAGS"] = XLA_FAST  # every run compiled alike, 3-6x faster (tests/deploy_runs.py)


EARLY: dict[str, Callable] = {}


def early(fn: Callable) -> Callable:
    """Registers ``fn(reference, root) -> dict``: a test's runs that need no live interaction.
    All start in background threads when the ``reference`` fixture is created; the test collects
    the dict with ``reference.started(fn.__name__)``."""
    EARLY[fn.__name__] = fn
    return fn


class Reference:
    """One uninterrupted run (``wait`` for it; ``copy`` its workdir), and the ``early`` runs."""

    def __init__(self, root):
        self.root = root
        self.workdir, self.record = root / "ref", root / "ref.idx"
        self.proc = Proc(self.workdir, instrumented=True, throttled=True,
                         env={"NORMVIT_TEST_RECORD": str(self.record)})
        self._lock = threading.Lock()
        self._done = False
        self._results: dict[str, dict | BaseException] = {}
        self._procs: list[Proc] = [self.proc]
        self._threads = {name: threading.Thread(target=self._launch, args=(name, fn), daemon=True)
                         for name, fn in EARLY.items()}
        for t in self._threads.values():
            t.start()

    def wait(self) -> "Reference":
        with self._lock:
            if not self._done:
                self.proc.expect(cli.EXIT_OK, rf"Done at step {STEPS}")
                self._done = True
        return self

    def copy(self, dest) -> str:
        self.wait()
        shutil.copytree(self.workdir, dest, ignore=shutil.ignore_patterns(".lock"))
        return str(dest)

    def _launch(self, name: str, fn: Callable) -> None:
        try:
            self._results[name] = fn(self, self.root / name)
        except BaseException as e:  # noqa: BLE001  (raised again by started())
            self._results[name] = e

    def started(self, name: str) -> dict:
        self._threads[name].join(TIMEOUT * 3)
        result = self._results.get(name)
        if not isinstance(result, dict):
            raise AssertionError(f"the early runs of {name} failed: {result!r}") from (
                result if isinstance(result, BaseException) else None)
        return result

    def kill_all(self) -> None:
        runs = [self.proc] + [r for res in self._results.values() if isinstance(res, dict)
                              for r in res.values() if isinstance(r, Proc)]
        for r in runs:
            if r.p.poll() is None:
                r.p.kill()


@pytest.fixture(scope="module")
def reference(tmp_path_factory, _subprocess_env):
    ref = Reference(tmp_path_factory.mktemp("reference"))
    yield ref
    ref.kill_all()


# ---------------------------------------------------------------------------------- helpers


def assert_same_run(workdir_a, workdir_b, step: int = STEPS) -> None:
    """Every array of the train state bitwise equal, and the same summaries (timing aside)."""
    a, _ = checkpoints.load_state(str(workdir_a), step)
    b, _ = checkpoints.load_state(str(workdir_b), step)
    la, ta = jax.tree_util.tree_flatten_with_path(a)
    lb, tb = jax.tree_util.tree_flatten_with_path(b)
    assert ta == tb
    for (path, x), (_, y) in zip(la, lb):
        np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(path))
    sa = summaries.read_scalars(str(workdir_a), include_timing=False)
    sb = summaries.read_scalars(str(workdir_b), include_timing=False)
    assert sorted(sa) == sorted(sb)
    for tag in sa:
        assert [(s, v) for s, v, _ in sa[tag]] == [(s, v) for s, v, _ in sb[tag]], tag
    assert [s for s, _, _ in sa["train/loss"]] == list(range(2, step + 1, 2))
    assert [s for s, _, _ in sa["eval/top1"]] == sorted({*range(10, step + 1, 10), step})


def partial_checkpoints(workdir) -> list[str]:
    d = os.path.join(workdir, "checkpoints")
    return [n for n in os.listdir(d) if not n.isdigit()] if os.path.isdir(d) else []


def read_record(path) -> list[list[int]]:
    with open(path) as f:
        return [list(map(int, line.split())) for line in f]


def truncate_largest_file(step_dir) -> str:
    """Cuts the largest OCDBT data file (``.../d/<hash>``) in half, as a write cut short would.
    Data files only: how OCDBT packs arrays into them depends on timing, so sometimes the tree
    metadata (_METADATA) is the largest file, which fails differently."""
    files = [p for p in glob.glob(os.path.join(step_dir, "**", "d", "*"), recursive=True)
             if os.path.isfile(p)]
    victim = max(files, key=os.path.getsize)
    with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) // 2)
    return victim


def wait_until(predicate, timeout: float = TIMEOUT, what: str = "") -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------- the faults
# In file order: the 2-host test first, alone (its hosts must start within gloo's 30 s of each
# other); then the reference run with the first sequential test, and the ``early`` runs.


def test_sigterm_on_one_host_stops_every_host_at_the_same_step(tmp_path):
    """Two JAX processes (a 2-host run on CPU): SIGTERM to host 1 only; both checkpoint the
    same step together and exit 42."""
    wd, port = tmp_path / "run", free_port()
    hosts = [Proc(wd, "--config.data.return_index=False", env={
        "JAX_COORDINATOR_ADDRESS": f"localhost:{port}", "JAX_NUM_PROCESSES": "2",
        "JAX_PROCESS_ID": str(i)}) for i in range(2)]
    hosts[0].wait_for(rf"step 4/{STEPS}:")  # process 0 prints the metric lines
    hosts[1].p.send_signal(signal.SIGTERM)
    stopped = []
    for h in hosts:
        h.expect(cli.EXIT_PREEMPTED, r"interrupted at step \d+; saved in ")
        stopped.append(int(re.search(r"interrupted at step (\d+)", h.output).group(1)))
    assert stopped[0] == stopped[1] < STEPS
    assert max(checkpoints.complete_steps(wd)) == stopped[0]


def test_sigterm_sigkill_mid_save_and_second_process_lose_nothing(reference, tmp_path):
    """SIGTERM at a random step -> checkpoint, exit 42; the re-run continues, a second process on
    the same workdir is refused, then SIGKILL lands while a checkpoint is half-written; the third
    run resumes from the newest complete checkpoint, removes the partial one and ends bitwise
    equal to the uninterrupted run, having consumed the same examples in the same order."""
    wd = tmp_path / "run"
    k = random.choice([4, 6, 8])  # a log line every 2 steps; SIGTERM when step k is logged
    rec = [tmp_path / f"seg{i}.idx" for i in range(3)]

    first = Proc(wd, instrumented=True, env={"NORMVIT_TEST_RECORD": str(rec[0])})
    first.wait_for(rf"step {k}/{STEPS}:")
    first.p.send_signal(signal.SIGTERM)
    first.expect(cli.EXIT_PREEMPTED, r"SIGTERM received",
                 r"interrupted at step \d+; saved in \S+; rerun the same command to resume")
    p = int(re.search(r"interrupted at step (\d+)", first.output).group(1))
    assert k <= p < STEPS, (k, p)
    assert max(checkpoints.complete_steps(wd)) == p

    second = Proc(wd, instrumented=True,
                  env={"NORMVIT_TEST_RECORD": str(rec[1]), "NORMVIT_TEST_HOLD_COMMIT": "600"})
    second.wait_for(rf"Resumed from the checkpoint at step {p} in ")
    wait_until(lambda: partial_checkpoints(wd), what="a checkpoint being written")
    intruder = Proc(wd)
    intruder.expect(cli.EXIT_BUSY, rf"is in use by pid {second.p.pid} on host")
    second.p.kill()  # SIGKILL while the checkpoint's files are written but not committed
    assert second.finish() == -signal.SIGKILL
    partial = partial_checkpoints(wd)
    assert partial, "the killed save left no partial checkpoint to test with"
    assert int(partial[0].split(".")[0]) > p
    assert max(checkpoints.complete_steps(wd)) == p  # the partial one is not a step

    third = Proc(wd, instrumented=True, env={"NORMVIT_TEST_RECORD": str(rec[2])})
    third.expect(cli.EXIT_OK, rf"Resumed from the checkpoint at step {p} in ", rf"Done at step {STEPS}")
    assert partial_checkpoints(wd) == []

    reference.wait()
    assert_same_run(reference.workdir, wd)
    # Steps 1..p from the first run, none kept from the killed one, p+1..24 from the third.
    seen = read_record(rec[0]) + read_record(rec[2])
    assert len(read_record(rec[0])) == p and len(seen) == STEPS
    assert seen == read_record(reference.record)
    flat = [i for batch in seen for i in batch]
    assert len(flat) == len(set(flat)) == STEPS * 32  # 768 < 1,442: one epoch, none repeated


NAN_FLAGS = ["--config.optimizer.learning_rate=1e30", "--config.optimizer.grad_clip=0",
             "--config.checkpoint_every=1", "--config.total_steps=8"]


@early
def nonfinite(ref: Reference, root) -> dict:
    """lr 1e30 without clipping (a real override) overflows the loss; then the same run again
    with skip_nonfinite_steps=2. Needs no reference run."""
    wd = root / "run"
    stop = Proc(wd, *NAN_FLAGS, throttled=True)
    stop.finish()
    state = checkpoints.load_state(str(wd))[0] if checkpoints.complete_steps(wd) else None
    skip = Proc(wd, *NAN_FLAGS, "--config.skip_nonfinite_steps=2",
                "--config.allow_config_change=True", throttled=True)
    skip.finish()
    return {"wd": wd, "stop": stop, "state_at_stop": state, "skip": skip}


def test_nonfinite_loss_stops_and_keeps_the_last_good_checkpoint(reference):
    """The run stops naming the step, the metric and the last good checkpoint, and saves nothing
    bad; with skip_nonfinite_steps=2 the re-run skips the bad updates (counted in the summaries)
    and stops after 2 in a row."""
    runs = reference.started("nonfinite")
    wd, stop, skip = runs["wd"], runs["stop"], runs["skip"]
    stop.expect(cli.EXIT_NONFINITE, r"Stopped: non-finite loss")
    m = re.search(r"non-finite [a-z_ ]+ at step (\d+).*last good checkpoint: step (\d+) in (\S+)\.",
                  stop.output)
    bad, good = int(m.group(1)), int(m.group(2))
    assert good == bad - 1 and m.group(3) == str(wd / "checkpoints")
    state = runs["state_at_stop"]
    assert int(state["step"]) == good  # the newest checkpoint when the run stopped
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(state) if x.dtype.kind == "f")

    skip.expect(cli.EXIT_NONFINITE, rf"Resumed from the checkpoint at step {good} in ",
                rf"2 updates in a row had a non-finite loss or grad_norm and were skipped "
                rf"\(steps {bad} to {bad + 1}; config.skip_nonfinite_steps=2\); last good "
                rf"checkpoint: step {bad} in")
    kept, _ = checkpoints.load_state(str(wd), bad)  # saved after one skipped update: unchanged
    for x, y in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(kept["params"])):
        np.testing.assert_array_equal(x, y)
    assert int(kept["step"]) == bad and int(kept["nonfinite_streak"]) == 1
    skipped = summaries.read_scalars(str(wd))["train/skipped_nonfinite_total"]
    assert skipped[-1][:2] == (bad + 1, 2.0)


@early
def damaged(ref: Reference, root) -> dict:
    """Copies of the reference: one with its newest checkpoint truncated, one with all three
    truncated; the latter is then run again with --fresh."""
    one, every = ref.copy(root / "one"), ref.copy(root / "every")
    truncate_largest_file(os.path.join(one, "checkpoints", "24"))
    for s in (15, 20, 24):
        truncate_largest_file(os.path.join(every, "checkpoints", str(s)))
    resumed, refused = Proc(one, throttled=True), Proc(every, throttled=True)
    refused.finish()
    steps_after_refusal = checkpoints.complete_steps(every)
    fresh = Proc(every, "--fresh", throttled=True)
    return {"one": one, "every": every, "resumed": resumed, "refused": refused,
            "steps_after_refusal": steps_after_refusal, "fresh": fresh}


def test_damaged_checkpoints_are_skipped_or_refused_and_fresh_is_explicit(reference):
    """A truncated newest checkpoint: skipped with a warning naming it and the file, moved
    aside, the run resumes from the previous one and ends equal to the reference. All damaged:
    exit 4 naming each, nothing touched. --fresh: the old run moves to replaced/, training
    restarts from step 0 and ends equal to the reference again."""
    runs = reference.started("damaged")
    runs["resumed"].expect(
        cli.EXIT_OK, r"Checkpoint at step 24 in \S+ is damaged \(ValueError: .*local file .*\); "
        r"moved to \S+damaged_checkpoints/24; using step 20 instead",
        r"Resumed from the checkpoint at step 20 in ", rf"Done at step {STEPS}")
    assert_same_run(reference.workdir, runs["one"])

    runs["refused"].expect(cli.EXIT_CHECKPOINT, r"no checkpoint in \S+ restores: step 24: .*; step "
                           r"20: .*; step 15: .*Nothing was moved or deleted. Re-run with --fresh")
    assert runs["steps_after_refusal"] == [15, 20, 24]
    every = runs["every"]
    runs["fresh"].expect(cli.EXIT_OK, r"--fresh: moved the previous run", rf"Done at step {STEPS}")
    (moved,) = glob.glob(os.path.join(every, "replaced", "*"))
    assert sorted(os.listdir(os.path.join(moved, "checkpoints"))) == ["15", "20", "24"]
    assert_same_run(reference.workdir, every)


@early
def changed_model(ref: Reference, root) -> dict:
    """A wider model in a copy of the reference: refused; then with allow_config_change."""
    wd = ref.copy(root / "run")
    saved = open(os.path.join(wd, "config.json")).read()
    refused = Proc(wd, "--config.model.hidden_size=48")
    refused.finish()
    mismatch = Proc(wd, "--config.model.hidden_size=48", "--config.allow_config_change=True",
                    throttled=True)
    return {"wd": wd, "saved": saved, "refused": refused, "mismatch": mismatch}


def test_changed_config_is_refused_with_a_diff_and_a_model_mismatch_is_named(reference):
    runs = reference.started("changed_model")
    wd = runs["wd"]
    runs["refused"].expect(cli.EXIT_CONFIG, r"holds a run made with another config; changed keys:",
                           r"model.hidden_size: 32 -> 48", r"--config.allow_config_change=True")
    runs["mismatch"].expect(
        cli.EXIT_CHECKPOINT, r"the checkpoint at step 24 in \S+ does not match the model built "
        r"from the config: params/Transformer/encoder_norm/bias: \(32,\) float32 in the "
        r"checkpoint, \(48,\) float32 in the model")
    assert open(os.path.join(wd, "config.json")).read() == runs["saved"]  # untouched by refusals
    assert checkpoints.complete_steps(wd) == [15, 20, 24]


@early
def disk_full(ref: Reference, root) -> dict:
    """Files may not grow past 16 kB (RLIMIT_FSIZE; writes fail as on a full disk) while the run
    is extended to 27 steps (allow_config_change), so the checkpoint of step 25 fails: its tree
    metadata (_METADATA, ~34 kB) is always one file, while how OCDBT packs the arrays into data
    files depends on timing (with 40 kB, a save sometimes fitted)."""
    wd = ref.copy(root / "run")
    full = Proc(wd, "--config.total_steps=27", "--config.allow_config_change=True", throttled=True)
    resource.prlimit(full.p.pid, resource.RLIMIT_FSIZE, (16_000, 16_000))  # Python ignores SIGXFSZ
    return {"wd": wd, "full": full}


def test_disk_full_during_a_save_keeps_the_previous_checkpoint(reference):
    """Exit 5 naming the step that failed and the newest complete checkpoint, which is intact."""
    runs = reference.started("disk_full")
    wd = runs["wd"]
    runs["full"].expect(
        cli.EXIT_WORKDIR, r"Resumed from the checkpoint at step 24 in ",
        r"writing the checkpoint of step 25 to \S+ failed \(.*File too large.*\); the newest "
        r"complete checkpoint \(step 24\) is kept")
    assert checkpoints.complete_steps(wd) == [15, 20, 24]
    a, _ = checkpoints.load_state(wd, 24)
    b, _ = checkpoints.load_state(str(reference.workdir), 24)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)


@early
def unwritable(ref: Reference, root) -> dict:
    wd = ref.copy(root / "run")
    before = {p: os.stat(p).st_mtime_ns for p in glob.glob(f"{wd}/**", recursive=True)}
    for p in before:
        os.chmod(p, os.stat(p).st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    gs = Proc("gs://normvit-test-no-such-bucket/run", env={
        "GOOGLE_APPLICATION_CREDENTIALS": "", "CLOUDSDK_CONFIG": str(root / "gcloud"),
        "GCE_METADATA_HOST": "127.0.0.1:9"})
    return {"wd": wd, "before": before, "readonly": Proc(wd, as_plain_user=True), "gs": gs}


def test_unwritable_workdir_and_gcs_without_credentials_fail_clearly(reference):
    runs = reference.started("unwritable")
    wd, before = runs["wd"], runs["before"]
    try:
        runs["gs"].expect(cli.EXIT_WORKDIR, r"gs://normvit-test-no-such-bucket/run: no Google "
                          r"Cloud credentials found .*gcloud auth application-default login")
        if runs["readonly"].finish() == EXIT_NO_CAPS:
            pytest.skip("root without CAP_SETPCAP: cannot make a directory unwritable for a child")
        runs["readonly"].expect(cli.EXIT_WORKDIR,
                                rf"the workdir {wd} is not writable \(PermissionError")
        after = {p: os.stat(p).st_mtime_ns for p in glob.glob(f"{wd}/**", recursive=True)}
        assert after == before  # nothing written, nothing removed
    finally:
        for p in before:
            os.chmod(p, os.stat(p).st_mode | stat.S_IWUSR)


def test_read_scalars_keeps_what_the_last_segment_wrote(tmp_path):
    """Segment 1 wrote steps 1-6 and was killed; segment 2 resumed at 3 (its marker) and wrote
    4-5 with other values, then its file was cut mid-record: the history is 1-3 from segment 1
    and 4-5 from segment 2; step 6 of the dead segment is gone."""
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    def write(points, suffix):
        w = EventFileWriter(str(tmp_path), filename_suffix=suffix)
        for tag, step, value in points:
            summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=tag, simple_value=value)])
            w.add_event(event_pb2.Event(step=step, wall_time=time.time(), summary=summary))
        w.close()
        time.sleep(0.01)
        return w.get_logdir()

    write([(summaries.SEGMENT_TAG, 0, 0.0)] + [("loss", s, float(s)) for s in range(1, 7)], ".a")
    write([(summaries.SEGMENT_TAG, 3, 3.0), ("loss", 4, 40.0), ("loss", 5, 50.0)], ".b")
    (last,) = [p for p in glob.glob(str(tmp_path / "events.out.tfevents*")) if p.endswith(".b")]
    with open(last, "ab") as f:
        f.write(b"\x40\x00\x00\x00\x00\x00\x00\x00garbage")  # a record cut short
    got = summaries.read_scalars(str(tmp_path))
    assert list(got) == ["loss"]
    assert [(s, v) for s, v, _ in got["loss"]] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0)]


def test_a_gs_checkpoint_without_its_commit_file_is_not_a_step(tmp_path, monkeypatch, caplog):
    """On gs:// Orbax writes a checkpoint under its final name (a rename there is a copy) and
    commits it with commit_success.txt written last: a save in flight, or one a SIGKILL cut short,
    is a step folder without that file. Orbax's manager skips it; the tools listed it as a step
    and warned that it was damaged (predict beside a run on gs:// did so at every save).
    Emulated locally by giving the folder Orbax's gs:// rule."""
    from orbax.checkpoint._src.path import gcs_utils

    wd = tmp_path / "run"
    mngr = checkpoints.make_manager(str(wd), async_save=False)
    for step in (1, 2):
        checkpoints.save(mngr, step, {"w": np.arange(4, dtype=np.float32) + 10 * step})
    mngr.close()
    (wd / "config.json").write_text("{}")
    os.remove(wd / "checkpoints" / "2" / "commit_success.txt")  # step 2's commit never came
    monkeypatch.setattr(gcs_utils, "is_gcs_path", lambda path: True)

    assert checkpoints.complete_steps(str(wd)) == [1]
    with caplog.at_level("WARNING"):
        restored, _ = checkpoints.restore_numpy(str(wd))
    assert restored.step == 1 and not restored.damaged
    np.testing.assert_array_equal(restored.state["w"], np.arange(4, dtype=np.float32) + 10)
    assert not [r for r in caplog.records if "damaged" in r.getMessage()]
