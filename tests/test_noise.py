"""Issue 28, point 8: a run's normal output is what the user needs and nothing else: library
chatter and the echoes of a failed checkpoint read/write are dropped (logs.py), only process 0
prints the metric lines, launch/tpu_pod.sh warns about a local REPO path, and a log-scale panel always
has at least three labelled ticks."""
from __future__ import annotations

import logging as std_logging
import os
import subprocess
import types

import pytest

from normvit_jax import logs
from normvit_jax.analysis import figures
from tests.conftest import REPO_ROOT

SITE = "/x/site-packages"


def _record(path: str, level: int, msg: str, name: str = "absl", exc_info=None):
    return std_logging.LogRecord(name, level, path, 1, msg, (), exc_info)


def _orbax_exc_info():
    """An exception whose traceback passes through a frame of a file under /orbax/."""
    code = compile("def write():\n    raise ValueError('OUT_OF_RANGE: Failed writing')\n",
                   f"{SITE}/orbax/checkpoint/_src/serialization/serialization.py", "exec")
    scope: dict = {}
    exec(code, scope)
    try:
        scope["write"]()
    except ValueError as e:
        return (ValueError, e, e.__traceback__)


def test_library_chatter_and_failure_echoes_are_dropped_and_the_rest_kept():
    f = logs.QuietLibraries()
    drop = [
        _record(f"{SITE}/tensorflow_datasets/core/dataset_info.py", std_logging.INFO,
                "Load dataset info from %s"),
        _record(f"{SITE}/orbax/checkpoint/checkpoint_manager.py", std_logging.WARNING,
                "CheckpointManagerOptions.read_only=True, setting save_interval_steps=0."),
        _record(f"{SITE}/orbax/checkpoint/checkpoint_manager.py", std_logging.WARNING,
                "Given directory is read only=%s"),
        _record(f"{SITE}/orbax/checkpoint/_src/futures/future.py", std_logging.ERROR,
                "_SignalingThread.run() raised an exception: %s"),
        _record(f"{SITE}/orbax/checkpoint/_src/metadata/checkpoint.py", std_logging.ERROR,
                "Failed to read Metadata file: %s"),
        # a step whose state/_METADATA is gone (checkpoints.py's warning names it)
        _record(f"{SITE}/orbax/checkpoint/_src/handlers/composite_checkpoint_handler.py",
                std_logging.WARNING, 'Item "%s" was found in the checkpoint, but could not be '
                "restored. Please provide a `CheckpointHandlerRegistry`, or call `restore` with "
                "an appropriate `CheckpointArgs` subclass."),
        _record("/usr/lib/python3/asyncio/base_events.py", std_logging.ERROR,
                "Task exception was never retrieved", name="asyncio",
                exc_info=_orbax_exc_info()),
        # a TensorStore write into Orbax's temporary folder: no traceback, the path names it
        _record("/usr/lib/python3/asyncio/base_events.py", std_logging.ERROR,
                "Future exception was never retrieved\nfuture: <Future finished exception="
                "ValueError('OUT_OF_RANGE: Error writing \"rng/0\" in OCDBT database at local file "
                "\"/w/checkpoints/25.orbax-checkpoint-tmp/state\"')>", name="asyncio",
                exc_info=(ValueError, ValueError("OUT_OF_RANGE"), None)),
        # a read of a damaged checkpoint, the same way
        _record("/usr/lib/python3/asyncio/base_events.py", std_logging.ERROR,
                "Future exception was never retrieved\nfuture: <Future finished exception="
                "ValueError('DATA_LOSS: Error reading \"params.x/0\" in OCDBT database at local "
                "file \"/w/checkpoints/6/state/ocdbt.process_0/\"')>", name="asyncio",
                exc_info=(ValueError, ValueError("DATA_LOSS"), None)),
    ]
    drop += [  # what an export printed between its report lines
        _record(f"{SITE}/tensorflow/python/checkpoint/functional_saver.py", std_logging.INFO,
                "Sharding callback duration: %s"),
        _record(f"{SITE}/jax2onnx/user_interface.py", std_logging.INFO,
                "Converting JAX function to ONNX model with parameters: %s"),
        _record(f"{SITE}/onnx_ir/passes/common/unused_removal.py", std_logging.INFO,
                "Removed %s unused nodes")]
    keep = [
        _record(f"{SITE}/tensorflow/python/saved_model/save.py", std_logging.WARNING, "a warning"),
        _record(f"{SITE}/orbax/checkpoint/checkpoint_manager.py", std_logging.WARNING,
                "Something else went wrong"),
        _record(f"{SITE}/tensorflow_datasets/core/load.py", std_logging.WARNING, "a real warning"),
        _record("/usr/lib/python3/asyncio/base_events.py", std_logging.ERROR,
                "Task exception was never retrieved", name="asyncio"),  # not Orbax's: shown
        _record("/x/normvit_jax/train/loop.py", std_logging.INFO, "step 1/2"),
        _record("/x/normvit_jax/cli.py", std_logging.ERROR, "Stopped: writing the checkpoint"),
    ]
    assert [f.filter(r) for r in drop] == [False] * len(drop)
    assert [f.filter(r) for r in keep] == [True] * len(keep)


def test_event_loop_closed_and_orbax_coroutine_echoes_are_dropped_other_unraisables_are_not():
    seen = []
    hook = logs._quiet_unraisable(seen.append)
    closed = types.SimpleNamespace(exc_value=RuntimeError("Event loop is closed"))
    other = types.SimpleNamespace(exc_value=RuntimeError("something else"))
    _, error, tb = _orbax_exc_info()  # "Exception ignored in: <coroutine ... device_put>"
    orbax_read = types.SimpleNamespace(exc_value=error, exc_traceback=tb)
    hook(closed)
    hook(other)
    hook(orbax_read)
    assert seen == [other]


def test_only_process_zero_prints_the_metric_lines():
    def line(msg: str, level: int = std_logging.INFO):
        return _record("/x/normvit_jax/train/loop.py", level, msg)

    f = logs.MetricsFromProcessZero()
    assert not f.filter(line("step %d/%d: loss %.4f, accuracy %.4f"))
    assert not f.filter(line("eval at step %d: loss %.4f, top-1 %.4f"))
    for kept in (line("Resumed from the checkpoint at step %d in %s"), line("Model: %s"),
                 line("step %d/%d: bad", std_logging.WARNING)):
        assert f.filter(kept)
    absl_logger = std_logging.getLogger("absl")
    logs.only_process_zero_informs(0)
    assert not any(isinstance(x, logs.MetricsFromProcessZero) for x in absl_logger.filters)
    try:
        logs.only_process_zero_informs(1)
        assert any(isinstance(x, logs.MetricsFromProcessZero) for x in absl_logger.filters)
    finally:
        absl_logger.removeFilter(logs._METRICS_FILTER)
        for h in std_logging.getLogger().handlers:
            h.removeFilter(logs._METRICS_FILTER)


@pytest.mark.parametrize("repo,warned", [("/home/me/normvit_jax", True),
                                         ("file:///srv/git/n.git", True),
                                         ("https://example.org/n.git", False),
                                         ("git@github.com:me/n.git", False)])
def test_tpu_pod_warns_about_a_local_repo_path(repo, warned):
    env = {**os.environ, "TPU": "t", "ZONE": "z", "REPO": repo, "REF": "abc"}
    r = subprocess.run(["bash", os.path.join(REPO_ROOT, "launch", "tpu_pod.sh"), "--dry-run",
                        "configs/vit_ln.py", "gs://b/run"], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("warning:")]
    assert len(lines) == int(warned)
    if warned:
        assert repo in lines[0] and "set REPO to a URL" in lines[0]


@pytest.mark.parametrize("lo,hi,expected", [
    (1.5, 1.9, [1.5, 1.6, 1.7, 1.8]),           # inside one 1..9 step: plain numbers
    (2.5, 9.0, [3, 4, 5, 6, 7, 8, 9]),          # one decade: every integer multiple
    (0.3, 40.0, [0.5, 1, 2, 5, 10, 20]),        # two decades: 1-2-5
    (1e-3, 1e3, [1e-3, 1e-2, 0.1, 1, 10, 100, 1e3]),  # many: powers of ten
    (3.0, 31.0, [5, 10, 20]),
])
def test_log_axis_has_at_least_three_labelled_ticks(lo, hi, expected):
    fig = figures.figure(3, 2)
    ax = fig.add_subplot()
    ax.plot([0, 1], [lo, hi])
    figures.log_y(ax)
    ax.set_ylim(lo, hi)
    fig.canvas.draw()
    ticks = [t for t in ax.get_yticks() if lo <= t <= hi]
    assert ticks == pytest.approx(expected)
    labels = [t.get_text() for t in ax.get_yticklabels() if t.get_text()]
    assert len(labels) >= 3 and len(set(labels)) == len(labels)


def test_fresh_moves_old_eval_results_aside_with_the_run(tmp_path):
    from normvit_jax import workdir
    (tmp_path / "checkpoints" / "6").mkdir(parents=True)
    for name in ("config.json", "eval_digits_test_6.json", "eval_digits_test_confusion_6.png",
                 "eval_imagenet_v2_test_6.json", "notes.json"):
        (tmp_path / name).write_text("{}")
    dest = workdir.move_run_aside(str(tmp_path))
    assert sorted(os.listdir(dest)) == ["checkpoints", "config.json", "eval_digits_test_6.json",
                                        "eval_digits_test_confusion_6.png",
                                        "eval_imagenet_v2_test_6.json"]
    assert sorted(os.listdir(tmp_path)) == ["notes.json", "replaced"]  # not the run's: kept
