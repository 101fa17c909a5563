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
