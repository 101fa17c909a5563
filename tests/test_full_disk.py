"""A full disk (ENOSPC, simulated by making the write or flush raise) at each place that writes:
one line, its documented exit code, nothing partial left behind, nothing lost that was there."""
from __future__ import annotations

import errno
import json
import os

import pytest

from tests.conftest import tiny_demo_config


def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def _one_line(err: str, caplog, pattern: str) -> None:
    """No traceback nor logging error on stderr, one 'Stopped:' line (cli._stop) with ``pattern``."""
    assert "Traceback" not in err, err
    assert "--- Logging error ---" not in err, err
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Stopped:")]
    assert len(lines) == 1 and pattern in lines[0] and "\n" not in lines[0], lines


def test_tensorboard_on_a_full_disk_is_exit_5_in_one_line(tmp_path, monkeypatch, capsys, caplog):
    """A summary flush that fails crashed training (exit 1) with a chained traceback, raised
    again by the writer's close. Now: the WorkdirError of a failed checkpoint, exit 5, status.json
    says failed, and no .status.json.tmp is left."""
    from normvit_jax import cli, run_log
    from tensorboard.summary.writer import record_writer
    calls = []
    real = record_writer.RecordWriter.flush

    def flush(self):
        calls.append(1)
        if len(calls) > 3:
            _enospc()
        real(self)

    monkeypatch.setattr(record_writer.RecordWriter, "flush", flush)
    wd = tmp_path / "w"
    assert cli.run(tiny_demo_config(), str(wd)) == cli.EXIT_WORKDIR
    _one_line(capsys.readouterr().err, caplog, "writing the TensorBoard summaries to")
    status = json.load(open(wd / run_log.STATUS_NAME))
    assert (status["state"], status["exit_code"]) == ("failed", cli.EXIT_WORKDIR)
    assert "No space left on device" in status["message"]
    assert not (wd / f".{run_log.STATUS_NAME}.tmp").exists()


def test_a_status_record_that_does_not_fit_leaves_no_tmp(tmp_path, monkeypatch):
    from etils import epath

    from normvit_jax import run_log
    real = epath.Path.write_text

    def write_text(self, text, *a, **k):
        real(self, text[:3], *a, **k)
        _enospc()

    monkeypatch.setattr(epath.Path, "write_text", write_text)
    run_log.write_status(str(tmp_path), "running")
    assert os.listdir(tmp_path) == []


class _FullStream:
    """A file on a full disk: every write and flush raises ENOSPC."""

    def __init__(self, real):
        self.real = real

    def write(self, text):
        _enospc()

    def flush(self):
        _enospc()

    def close(self):
        self.real.close()


def test_training_log_on_a_full_disk_fails_once(tmp_path, monkeypatch, capsys, caplog):
    """The separator written at the start was outside the try that covers opening training.log
    (an unwritable one crashed the start, exit 1); mid-run each record printed a stdlib
    '--- Logging error ---' block and close() raised after a finished run. Now: one warning
    line, the file gets nothing more, the run goes on and its end is recorded."""
    import logging as std_logging

    from normvit_jax import run_log
    caplog.set_level(std_logging.INFO, logger="absl")
    real_open = std_logging.FileHandler._open
    monkeypatch.setattr(std_logging.FileHandler, "_open",
                        lambda self: _FullStream(real_open(self)))
    log = run_log.RunLog(str(tmp_path / "a"))
    os.makedirs(tmp_path / "a")
    log.start()  # the separator does not fit
    log.end("finished", 6, 0)
    assert run_log.read_status(str(tmp_path / "a"))["state"] == "finished"
    monkeypatch.setattr(std_logging.FileHandler, "_open", real_open)

    log = run_log.RunLog(str(tmp_path))
    log.start()
    handler = log._handler
    handler.stream = _FullStream(handler.stream)  # the disk fills mid-run
    from absl import logging
    for i in range(3):
        logging.info("step %d", i)
    log.end("finished", 6, 0, "a message")
    assert log._handler is None and handler not in logging.get_absl_logger().handlers
    err = capsys.readouterr().err
    assert "--- Logging error ---" not in err and "Traceback" not in err, err
    warnings = [r.getMessage() for r in caplog.records if "Cannot write" in r.getMessage()]
    assert len(warnings) == 2 and all("No space left on device" in w for w in warnings), warnings
    assert run_log.read_status(str(tmp_path))["state"] == "finished"


@pytest.mark.parametrize("where", ["tfds", "info"])
def test_prepare_into_a_full_data_dir_is_one_line_exit_2(tmp_path, monkeypatch, capsys, where):
    """tfds's 'Failed to finalize writing of split ... No space left on device' (RuntimeError) or
    the OSError writing prepare.json was a traceback, exit 1. Now: one line, exit 2 (a --data_dir
    that cannot be written), the .NAME.partial folder removed, nothing prepared."""
    import numpy as np
    import tensorflow_datasets as tfds

    from normvit_jax.data import prepare
    np.savez(tmp_path / "a.npz", images=np.zeros((8, 8, 8), np.uint8), labels=np.arange(8) % 2)
    if where == "tfds":
        def store(**kwargs):
            open(os.path.join(kwargs["data_dir"], "half.array_record"), "wb").write(b"x")
            raise RuntimeError("Failed to finalize writing of split 'train': [Errno 28] No space "
                               "left on device")
        monkeypatch.setattr(tfds.dataset_builders, "store_as_tfds_dataset", store)
    else:
        monkeypatch.setattr(prepare.json, "dump", _enospc)
    dd = tmp_path / "dd"
    with pytest.raises(SystemExit) as e:
        prepare.main([f"--src={tmp_path}/a.npz", "--name=full", f"--data_dir={dd}",
                      "--val_fraction=0.25"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("error: cannot write the dataset in --data_dir") and \
        "free disk space" in line, err
    assert os.listdir(dd) == [], os.listdir(dd)


@pytest.mark.parametrize("where", ["model", "sidecar"])
def test_export_to_a_full_disk_leaves_nothing_half_written(tmp_path, monkeypatch, where):
    """A full target was a traceback that left m.onnx.tmp, or a complete model with empty
    classes.json.tmp / m.onnx.json.tmp beside it and no sidecars. Now: one line, exit 2, no
    temporary file, the model renamed into place only after its sidecars; a model already there is
    untouched."""
    from normvit_jax import cli
    from normvit_jax.deploy import artifact, errors, stablehlo_format
    from tests.test_serve import _tiny_artifact
    out = str(tmp_path / "m.stablehlo")
    _tiny_artifact(out, fmt="stablehlo")
    before = {n: open(tmp_path / n, "rb").read() for n in os.listdir(tmp_path)}
    assert sorted(before) == ["classes.json", "m.stablehlo", "m.stablehlo.json"]
    if where == "model":
        real = stablehlo_format.write

        def write(b, path, batch, meta):
            real(b, path, batch, meta)
            open(path + ".tmp", "wb").write(b"half")
            _enospc()
        monkeypatch.setattr(stablehlo_format, "write", write)
    else:
        real_dump = artifact.json.dump
        calls = []

        def dump(value, f, **kw):
            calls.append(1)
            if len(calls) == 2:
                f.write("{")
                _enospc()
            real_dump(value, f, **kw)
        monkeypatch.setattr(artifact.json, "dump", dump)
    with pytest.raises(errors.DeployError) as e:
        _tiny_artifact(out, names=[f"digit {i}" for i in range(10)], fmt="stablehlo")
    assert cli.exit_code(e.value) == cli.EXIT_CONFIG
    assert "\n" not in str(e.value) and "free disk space" in str(e.value), e.value
    after = {n: open(tmp_path / n, "rb").read() for n in os.listdir(tmp_path)}
    assert after == before, sorted(after)


def test_a_full_workdir_says_free_disk_space_and_leaves_no_probe(tmp_path, monkeypatch):
    """main.py on a full workdir said 'fix its permissions' and left a 0-byte .write_probe."""
    from etils import epath

    from normvit_jax import workdir
    real = epath.Path.write_text

    def write_text(self, text, *a, **k):
        real(self, "", *a, **k)
        _enospc()

    monkeypatch.setattr(epath.Path, "write_text", write_text)
    with pytest.raises(workdir.WorkdirError) as e:
        workdir.check_writable(str(tmp_path))
    assert "free disk space or pass another --workdir" in str(e.value), e.value
    assert "permissions" not in str(e.value)
    assert os.listdir(tmp_path) == []
