"""What main.py does around ``train_and_evaluate``: distributed init, errors as short messages
with distinct exit codes; ``tool_errors`` gives the ``python -m`` tools the same codes
(docs/faults.md has the one table)."""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator

import ml_collections
from absl import logging

EXIT_OK = 0
EXIT_CONFIG = 2        # bad config, data not available, or a config change refused: fix the command
EXIT_NONFINITE = 3     # NaN/Inf loss or gradient (the last good checkpoint is kept)
EXIT_CHECKPOINT = 4    # a checkpoint does not fit this config, or none restores
EXIT_WORKDIR = 5       # workdir not writable, no credentials, a checkpoint write failed
EXIT_BUSY = 6          # another live process uses the workdir
EXIT_DISTRIBUTED = 7   # the processes of a multi-process run did not all meet (distributed.py)
EXIT_PREEMPTED = 42    # SIGTERM or Ctrl-C: checkpoint written, re-run to continue
EXIT_INTERRUPTED = 130  # Ctrl-C where there is nothing to save (128 + SIGINT)

# Error -> exit code, for training and evaluation alike; the first match wins (a subclass before
# its base). Named by module so that this table imports nothing: an error's class is loaded if
# the error was raised. Every other exception is a bug: its traceback is shown.
EXIT_CODES: tuple[tuple[str, str, int], ...] = (
    ("normvit_jax.train.policy", "PreemptedError", EXIT_PREEMPTED),
    ("normvit_jax.train.policy", "TrainingInterrupted", EXIT_PREEMPTED),  # Ctrl-C, saved
    ("normvit_jax.train.policy", "NonFiniteError", EXIT_NONFINITE),
    ("normvit_jax.workdir", "WorkdirBusyError", EXIT_BUSY),
    ("normvit_jax.distributed", "DistributedStartError", EXIT_DISTRIBUTED),
    ("normvit_jax.workdir", "WorkdirError", EXIT_WORKDIR),
    ("normvit_jax.checkpoints", "CheckpointMismatchError", EXIT_CHECKPOINT),
    # no workdir, config.json or checkpoint (of that step): the command points at the wrong place
    ("normvit_jax.checkpoints", "RunNotFoundError", EXIT_CONFIG),
    # export/serve: a format that cannot express the model, a missing extra, a bad artifact
    ("normvit_jax.deploy.errors", "DeployError", EXIT_CONFIG),
    # config checks, ConfigChangedError, DatasetNotFoundError, pretrained.CheckpointError
    ("builtins", "ValueError", EXIT_CONFIG),
)


TRACEBACK_ENV = "NORMVIT_TRACEBACK"  # set (to anything but '' or 0): known errors show theirs too


def _show_traceback(error: BaseException) -> None:
    """With $NORMVIT_TRACEBACK set, the traceback of a known error before its one line: a
    ValueError from a bug (not from a check) is otherwise indistinguishable from bad input, and
    a GPU lease's log is all there is to debug it with."""
    if os.environ.get(TRACEBACK_ENV, "") not in ("", "0"):
        import traceback
        traceback.print_exception(error, file=sys.stderr)


def exit_code(error: BaseException) -> int | None:
    """The exit code of ``error`` by ``EXIT_CODES`` (a process that stopped because another did:
    that one's code); None if it is not a known error."""
    peer = getattr(sys.modules.get("normvit_jax.distributed"), "PeerStoppedError", None)
    if peer is not None and isinstance(error, peer):
        return int(error.code)
    for module, name, code in EXIT_CODES:
        cls = getattr(sys.modules.get(module), name, None)
        if cls is not None and isinstance(error, cls):
            return code
    return None


def _one_line(error: Exception, prefix: str) -> int:
    """Called in an ``except`` clause: a known error (``EXIT_CODES``) printed as one line
    ``<prefix>error: <message>`` (its traceback first with $NORMVIT_TRACEBACK), returning its
    exit code; anything else re-raised with its traceback (a bug)."""
    code = exit_code(error)
    if code is None:
        raise error
    _show_traceback(error)
    print(f"{prefix}error: {error}", file=sys.stderr)
    return code


@contextlib.contextmanager
def tool_errors(prog: str) -> Iterator[None]:
    """For a ``python -m`` tool's main: a known error (``EXIT_CODES``) becomes one line
    ``<prog>: error: <message>`` and its exit code, Ctrl-C one line and 130, as in main.py."""
    try:
        yield
    except KeyboardInterrupt:
        print(f"{prog}: interrupted (Ctrl-C); stopped", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
    except Exception as e:  # noqa: BLE001  (known errors become exit codes)
        sys.exit(_one_line(e, f"{prog}: "))


def run(config: ml_collections.ConfigDict, workdir: str, fresh: bool = False) -> int:
    """Trains (``train_and_evaluate``, which holds the workdir lock and the SIGTERM flag; asked
    to end the process at once for a signal with nothing to save: ``exit_at_once``); returns the
    exit code (the table above)."""
    from normvit_jax import logs, preflight, sharding
    from normvit_jax import workdir as workdir_lib

    logs.quiet_library_logs()
    new_workdir = not (workdir_lib.is_remote(workdir) or os.path.lexists(workdir))
    try:
        preflight.check(config, workdir)  # before anything is written: a failed start leaves nothing
        # First: with several processes JAX installs its own SIGTERM notifier here.
        sharding.maybe_initialize_distributed()
        from normvit_jax.train import loop
        result = loop.train_and_evaluate(config, workdir, fresh=fresh, exit_at_once=True)
    except BaseException as e:  # noqa: BLE001  (known errors, a saved Ctrl-C too: exit codes)
        if exit_code(e) is None:  # a bug, or Ctrl-C with nothing saved (main.py: 130)
            raise
        if new_workdir and _single_process():  # stopped before writing anything: no empty run
            workdir_lib.remove_if_unused(workdir)
        return _stop(e)
    ev = result["eval"]
    if ev:
        logging.info("Done at step %d: eval top-1 %.4f, top-5 %.4f, loss %.4f.", result["step"],
                     ev["top1"], ev["top5"], ev["loss"])
    return EXIT_OK


def import_checkpoint(config: ml_collections.ConfigDict, workdir: str, fresh: bool = False,
                      evaluate: bool = True) -> int:
    """``--mode=import``: writes the run of step 0 holding ``config.init_from``
    (``train.importer``) and evaluates it once unless not ``evaluate``; returns the exit code."""
    from normvit_jax import logs, preflight, sharding
    from normvit_jax import workdir as workdir_lib

    logs.quiet_library_logs()
    new_workdir = not (workdir_lib.is_remote(workdir) or os.path.lexists(workdir))
    try:
        preflight.check(config, workdir)
        sharding.maybe_initialize_distributed()
        from normvit_jax.train import importer
        result = importer.import_run(config, workdir, fresh=fresh, evaluate=evaluate,
                                     exit_at_once=True)
    except Exception as e:  # noqa: BLE001  (known errors become exit codes)
        if exit_code(e) is None:
            raise
        if new_workdir and _single_process():
            workdir_lib.remove_if_unused(workdir)
        return _stop(e)
    ev = result["eval"]
    if ev:
        logging.info("Imported at step 0: eval top-1 %.4f, top-5 %.4f, loss %.4f.", ev["top1"],
                     ev["top5"], ev["loss"])
    return EXIT_OK


def evaluate(config: ml_collections.ConfigDict, workdir: str, step: int | None = None) -> int:
    """Evaluates a checkpoint of ``workdir`` (normvit_jax/evaluation.py), prints the metrics as
    JSON and writes them beside the checkpoints; returns the exit code (the table above)."""
    import json

    from normvit_jax import logs, sharding
    logs.quiet_library_logs()
    try:
        # one of several processes (local.sh, srun, a TPU pod) joins them, as training does: alone,
        # each evaluated the whole split on every device it saw (all GPUs of its node under srun)
        sharding.maybe_initialize_distributed()
        from normvit_jax import evaluation
        result = evaluation.evaluate_checkpoint(config, workdir, step)
    except Exception as e:  # noqa: BLE001  (known errors become exit codes)
        if exit_code(e) is None:
            raise
        return _stop(e)
    import jax
    if jax.process_index() == 0:  # one answer per run, as its result file (not one per process)
        print(json.dumps(result, sort_keys=True))
    return EXIT_OK


def show_config(config: ml_collections.ConfigDict) -> int:
    """``--mode=config``: the config as the run's config.json would hold it, as JSON on stdout,
    after the checks a training start makes before it touches data or a device (the config file
    loads, every value in range, the model buildable); a failed check is one line on stderr and
    its exit code. No JAX backend starts and nothing is written."""
    import json

    from normvit_jax import preflight, run_config
    try:
        preflight.check_loaded(config)
        preflight.check_values(config)
        preflight.check_model(config)
        preflight.check_empty_paths(config)
        values = run_config.saved_values(config)
    except Exception as e:  # noqa: BLE001  (known errors become exit codes)
        return _one_line(e, "")
    print(json.dumps(values, indent=2, sort_keys=True))
    return EXIT_OK


def _single_process() -> bool:
    """One process (another may still be using a shared workdir otherwise)."""
    import jax
    try:
        return jax.process_count() == 1
    except Exception:  # noqa: BLE001  (no backend could start: nothing ran)
        return True


def _stop(error: Exception) -> int:
    """Logs a known error in one line; returns its exit code."""
    code = exit_code(error)
    _show_traceback(error)
    if code == EXIT_PREEMPTED:
        logging.warning("%s", error)
    else:
        logging.error("Stopped: %s", error)
    return code


def load_config_file(spec: str) -> ml_collections.ConfigDict:
    """Loads ``path.py[:arg]`` the way ml_collections' config flag does (for error messages)."""
    import importlib.util

    path, _, arg = spec.partition(":")
    module_spec = importlib.util.spec_from_file_location("_normvit_cfg", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.get_config(arg) if arg else module.get_config()


def describe_flag_error(argv: list[str], error: BaseException) -> str:
    """A one-paragraph message for a bad ``--config...`` command line: the bad key, its value and
    the keys accepted at that level (instead of a traceback from deep inside ml_collections)."""
    from normvit_jax import config_paths
    spec = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
    overrides = [a[2:].split("=", 1) for a in argv if a.startswith("--config.")]
    if spec is not None:
        try:
            config = load_config_file(spec)
        except Exception as e:  # the config file itself is broken or the variant unknown
            return f"Cannot load --config={spec}: {type(e).__name__}: {e}"
        for item in overrides:
            key, value = item[0], (item[1] if len(item) > 1 else "<no value>")
            node, walked = config, ["config"]
            for part in key.split(".")[1:]:
                if not isinstance(node, ml_collections.ConfigDict) or part not in node:
                    accepted = sorted(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
                    hint = config_paths.did_you_mean(config, key[len("config."):])
                    return (f"Unknown config key --{key} (value {value!r}): "
                            f"{'.'.join(walked)} has no key {part!r}{hint}; accepted: {accepted}")
                node, walked = node[part], walked + [part]
            if isinstance(node, ml_collections.ConfigDict) and f"--{key}=" in str(error):
                # --config.model.norm=rmsnorm: a plain value where a group of keys is
                return (f"--{key}={value}: {'.'.join(walked)} is a group of keys, not a value; "
                        f"set one of them, e.g. --{key}."
                        f"{'name' if 'name' in node else sorted(node.keys())[0]}=...; "
                        f"accepted: {sorted(node.keys())}")
    return f"Bad command line: {type(error).__name__}: {error}"
