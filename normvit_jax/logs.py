"""Quieter logs for every entry point (main.py, export, reparam, the analysis CLIs): Orbax's, JAX's
and CLU's INFO chatter and Orbax's harmless 'Metadata file does not exist' warning (one per
checkpoint read) are dropped; other warnings and errors still show."""
from __future__ import annotations

import logging as std_logging
import os
import re

_NOISY_INFO = ("/orbax/", "/jax/_src/", "/clu/platform/")
_NOISY_WARNINGS = ("Metadata file does not exist",)  # Orbax, reading checkpoints without it


class QuietLibraries(std_logging.Filter):
    def filter(self, record: std_logging.LogRecord) -> bool:
        if "/orbax/" in record.pathname and str(record.msg).startswith(_NOISY_WARNINGS):
            return False
        return record.levelno >= std_logging.WARNING or not any(
            part in record.pathname for part in _NOISY_INFO)


_FILTER = QuietLibraries()


def quiet_library_logs() -> None:
    """Idempotent; call at the start of a CLI's main (after absl set up its handler)."""
    # TensorFlow and jaxlib each print the same oneDNN banner through their C++ INFO log.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    for target in [std_logging.getLogger("absl"), *std_logging.getLogger().handlers]:
        if _FILTER not in target.filters:
            target.addFilter(_FILTER)


def import_tensorflow_once() -> None:
    """Imports TensorFlow with its start-up lines printed once: its two C++ libraries each print
    the oneDNN banner (and absl's 'before InitializeLog' warning) before any log level applies."""
    import sys
    import tempfile
    if "tensorflow" in sys.modules:
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            import tensorflow  # noqa: F401
        except ImportError:
            pass
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        tmp.seek(0)
        captured = tmp.read().decode(errors="replace")
    seen, out = set(), []
    for line in captured.splitlines(keepends=True):
        key = re.sub(r"^([IWEF])\d{4} [\d:.]+\s+\d+ ", r"\1 ", line)  # without time and thread
        if key not in seen:
            seen.add(key)
            out.append(line)
    sys.stderr.write("".join(out))
    sys.stderr.flush()
