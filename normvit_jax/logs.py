"""Quieter logs for every entry point (main.py, export, reparam, the analysis CLIs): Orbax's, JAX's,
CLU's, tfds', TensorFlow's and the ONNX converter's INFO chatter and Orbax's harmless warnings (a
missing metadata file, a read-only manager) are dropped; other warnings and errors still show.

A failed checkpoint read or write (a damaged file, a full disk) is reported by this project in one
line naming the step and the innermost cause (checkpoints.restore_latest, train/guards.py), so the
same failure's echoes are dropped: Orbax's error records with tracebacks from its background
threads, asyncio's "exception was never retrieved" for Orbax's pending writes, TensorStore's
"Event loop is closed" (a write that completes after Orbax closed the loop that waited for it) and
Python's "Exception ignored in" for an Orbax coroutine that failed after nobody waited for it."""
from __future__ import annotations

import logging as std_logging
import os
import re
import sys
import warnings

# (export: the SavedModel writer's and the ONNX converter's progress notes, e.g. "Sharding callback
# duration", "Removed 91 unused nodes")
_NOISY_INFO = ("/orbax/", "/jax/_src/", "/clu/platform/", "/tensorflow_datasets/",
               "/tensorflow/python/", "/jax2onnx/", "/onnx_ir/")
_NOISY_WARNINGS = ("Metadata file does not exist",  # Orbax, reading checkpoints without it
                   "CheckpointManagerOptions.read_only=True", "Given directory is read only",
                   # a step without state/_METADATA, which checkpoints.py names in its own warning;
                   # Orbax's advice (a CheckpointHandlerRegistry) is for code, not the user
                   'Item "%s" was found in the checkpoint, but could not be restored')
# Orbax modules whose ERROR records repeat a checkpoint failure that the caller reports
_ECHOING_ERRORS = ("/orbax/checkpoint/_src/futures/future.py", "/orbax/checkpoint/checkpoint_manager.py",
                   "/orbax/checkpoint/_src/checkpointers/async_checkpointer.py",
                   "/orbax/checkpoint/_src/metadata/checkpoint.py")


def _orbax_traceback(record: std_logging.LogRecord) -> bool:
    return _passes_orbax(record.exc_info[2] if record.exc_info else None)


def _passes_orbax(tb) -> bool:
    while tb is not None:
        if "/orbax/" in tb.tb_frame.f_code.co_filename:
            return True
        tb = tb.tb_next
    return False


# A TensorStore read or write of a checkpoint that failed can surface as a Future with no Python
# traceback; its message names Orbax's temporary folder (a write) or the OCDBT database that Orbax
# stores checkpoints in (a read of a damaged one, a write). This project uses TensorStore only
# through Orbax, and reports such a failure itself in one line.
_ORBAX_SIGNS = (".orbax-checkpoint-tmp", "in OCDBT database at")


def _message(record: std_logging.LogRecord) -> str:
    try:
        return record.getMessage()
    except (TypeError, ValueError):
        return str(record.msg)


class QuietLibraries(std_logging.Filter):
    def filter(self, record: std_logging.LogRecord) -> bool:
        if "/orbax/" in record.pathname and str(record.msg).startswith(_NOISY_WARNINGS):
            return False
        if record.levelno >= std_logging.ERROR and record.pathname.endswith(_ECHOING_ERRORS):
            return False
        if record.name == "asyncio" and "never retrieved" in str(record.msg) \
                and (_orbax_traceback(record) or any(m in _message(record) for m in _ORBAX_SIGNS)):
            return False
        return record.levelno >= std_logging.WARNING or not any(
            part in record.pathname for part in _NOISY_INFO)


def _quiet_unraisable(previous):
    def hook(unraisable) -> None:
        if isinstance(unraisable.exc_value, RuntimeError) \
                and "Event loop is closed" in str(unraisable.exc_value):
            return
        # a read coroutine of a damaged checkpoint that failed after Orbax gave up waiting for it
        # ("Exception ignored in: <coroutine object _read_array_index_and_device_put>")
        if _passes_orbax(getattr(unraisable, "exc_traceback", None)):
            return
        previous(unraisable)
    hook.quiet = True
    return hook


_FILTER = QuietLibraries()


_ABSL_FORMAT = "absl format"  # the name of the handler absl_format adds


def absl_format() -> None:
    """A tool without absl.app (argparse: predict, report, prepare, ...) printed Python logging's
    default 'WARNING:normvit_jax.checkpoints:Checkpoint ...' beside main.py's and export's absl
    lines ('W1129 05:06:39.123456 1234 checkpoints.py:171] Checkpoint ...'): without absl's
    handler on the root logger, one stderr handler with absl's formatter takes the place of the
    default ones. Called by those tools' ``__main__`` blocks only (a test calling a tool's main
    in its own process keeps pytest's handlers). Idempotent; nothing changes under absl.app."""
    from absl import logging as absl_logging
    root = std_logging.getLogger()
    if absl_logging.get_absl_handler() in root.handlers \
            or any(h.get_name() == _ABSL_FORMAT for h in root.handlers):
        return
    for h in [h for h in root.handlers if type(h) is std_logging.StreamHandler  # noqa: E721
              and h.stream in (sys.stderr, sys.__stderr__)]:  # basicConfig's
        root.removeHandler(h)
    handler = std_logging.StreamHandler(sys.stderr)
    handler.set_name(_ABSL_FORMAT)
    handler.setFormatter(absl_logging.PythonFormatter())
    root.addHandler(handler)


def quiet_library_logs() -> None:
    """Idempotent; call at the start of a CLI's main (after absl set up its handler)."""
    # TensorFlow and jaxlib each print the same oneDNN banner through their C++ INFO log.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    for target in [std_logging.getLogger("absl"), std_logging.getLogger("asyncio"),
                   *std_logging.getLogger().handlers]:
        if _FILTER not in target.filters:
            target.addFilter(_FILTER)
    # the same failed write's last echo, at exit: the coroutine of a write that never started
    warnings.filterwarnings("ignore", message=r"coroutine 'async_serialize_from_host",
                            category=RuntimeWarning)
    # PIL on a phone's or an editor's metadata ("Corrupt EXIF data", "Possibly corrupt EXIF data",
    # a palette's transparency) and on a photo over 89 MP (a 108 MP phone photo: "could be
    # decompression bomb DOS attack"): two lines on stderr naming no file, about pixels that
    # decode; what cannot be decoded is named per file (prepare's summary, predict's skipped)
    warnings.filterwarnings("ignore", category=UserWarning, module=r"PIL\.")
    warnings.filterwarnings("ignore", message=r"Image size \(\d+ pixels\) exceeds limit",
                            category=RuntimeWarning)
    if not getattr(sys.unraisablehook, "quiet", False):
        sys.unraisablehook = _quiet_unraisable(sys.unraisablehook)


_METRIC_LINES = ("step %d/%d:", "eval at step %d:")  # the loop's progress and eval lines


class MetricsFromProcessZero(std_logging.Filter):
    """On processes other than 0: drops the loop's metric lines (every process computes the same
    global metrics); their start, resume, end, warnings and errors still show."""

    def filter(self, record: std_logging.LogRecord) -> bool:
        return not (record.levelno == std_logging.INFO
                    and str(record.msg).startswith(_METRIC_LINES))


_METRICS_FILTER = MetricsFromProcessZero()


def only_process_zero_informs(process_index: int) -> None:
    """Several processes: the metric lines come from process 0 only (called once
    jax.distributed is initialized)."""
    if process_index > 0:
        for target in [std_logging.getLogger("absl"), *std_logging.getLogger().handlers]:
            if _METRICS_FILTER not in target.filters:
                target.addFilter(_METRICS_FILTER)


# TensorFlow's __init__ imports Keras's optimizers eagerly (to register them for SavedModels
# holding Keras objects); the project saves and loads none, and that import is 40% of
# `import tensorflow` (2.5 of 6.5 s on 2 cores).
_KERAS_EAGER_IMPORT = "keras.src.optimizers"


def _import_tensorflow_without_keras() -> None:
    """``import tensorflow`` with TF's eager Keras import turned into the ImportError TF already
    catches (a ``None`` in sys.modules), removed again at once: ``tf.keras`` still loads in full
    on first use. If a TF release renames that import, TF simply imports Keras as before."""
    blocked = _KERAS_EAGER_IMPORT not in sys.modules
    if blocked:
        sys.modules[_KERAS_EAGER_IMPORT] = None  # type: ignore[assignment]
    try:
        import tensorflow  # noqa: F401
    finally:
        if blocked and sys.modules.get(_KERAS_EAGER_IMPORT, False) is None:  # still our block
            del sys.modules[_KERAS_EAGER_IMPORT]


def import_tensorflow_once() -> None:
    """Imports TensorFlow with its start-up lines printed once: its two C++ libraries each print
    the oneDNN banner (and absl's 'before InitializeLog' warning) before any log level applies.
    Called where the project first needs TensorFlow (the tf.data/tfds input pipelines, the
    SavedModel export). Off the main thread it only imports: the banner is caught by pointing the
    process's stderr elsewhere, which would hide other threads' output meanwhile."""
    import sys
    import tempfile
    import threading
    if "tensorflow" in sys.modules:
        return
    if threading.current_thread() is not threading.main_thread():
        _import_tensorflow_without_keras()
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            _import_tensorflow_without_keras()
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
