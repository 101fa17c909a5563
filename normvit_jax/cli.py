"""What main.py does around ``train_and_evaluate``: distributed init, errors as short messages
with distinct exit codes."""
from __future__ import annotations

from absl import logging
import ml_collections

EXIT_OK = 0
EXIT_CONFIG = 2        # bad config, data not available, or a config change refused: fix the command
EXIT_NONFINITE = 3     # NaN/Inf loss or gradient (the last good checkpoint is kept)
EXIT_CHECKPOINT = 4    # a checkpoint does not fit this config, or none restores
EXIT_WORKDIR = 5       # workdir not writable, no credentials, a checkpoint write failed
EXIT_BUSY = 6          # another live process uses the workdir
EXIT_DISTRIBUTED = 7   # the processes of a multi-process run did not all meet (distributed.py)
EXIT_PREEMPTED = 42    # SIGTERM: checkpoint written, re-run to continue


def run(config: ml_collections.ConfigDict, workdir: str, fresh: bool = False) -> int:
    """Trains; returns the exit code (the table above)."""
    from normvit_jax import distributed, logs, preemption, preflight, sharding
    from normvit_jax import workdir as workdir_lib

    logs.quiet_library_logs()
    try:
        preflight.check(config, workdir)  # before anything is written: a failed start leaves nothing
        # First: with several processes JAX installs its own SIGTERM notifier here.
        sharding.maybe_initialize_distributed()
        with preemption.SigtermFlag():  # from here on a SIGTERM means: checkpoint, exit 42
            return _train(config, workdir, fresh)
    except workdir_lib.WorkdirBusyError as e:
        return _stop(e, EXIT_BUSY)
    except distributed.DistributedStartError as e:
        return _stop(e, EXIT_DISTRIBUTED)
    except workdir_lib.WorkdirError as e:
        return _stop(e, EXIT_WORKDIR)
    except (workdir_lib.ConfigChangedError, ValueError) as e:
        return _stop(e, EXIT_CONFIG)


def _train(config: ml_collections.ConfigDict, workdir: str, fresh: bool) -> int:
    """Checks and locks the workdir before the slow imports (TensorFlow, via CLU), so a busy,
    unwritable or changed workdir is refused in seconds; then trains."""
    from normvit_jax import logs
    logs.import_tensorflow_once()  # (via CLU and tfds) before JAX, with its banner once
    import jax
    from normvit_jax import workdir as workdir_lib

    with workdir_lib.prepare(config, workdir, fresh=fresh, process_index=jax.process_index()):
        from normvit_jax import checkpoints, data
        from normvit_jax.train import loop
        try:
            result = loop.train_and_evaluate(config, workdir)
        except loop.PreemptedError as e:
            logging.warning("%s", e)
            return EXIT_PREEMPTED
        except loop.NonFiniteError as e:
            return _stop(e, EXIT_NONFINITE)
        except checkpoints.CheckpointMismatchError as e:
            return _stop(e, EXIT_CHECKPOINT)
        except data.DatasetNotFoundError as e:
            return _stop(e, EXIT_CONFIG)
    ev = result["eval"]
    if ev:
        logging.info("Done at step %d: eval top-1 %.4f, top-5 %.4f, loss %.4f.", result["step"],
                     ev["top1"], ev["top5"], ev["loss"])
    return EXIT_OK


def evaluate(config: ml_collections.ConfigDict, workdir: str, step: int | None = None) -> int:
    """Evaluates a checkpoint of ``workdir`` (normvit_jax/evaluation.py), prints the metrics as
    JSON and writes them beside the checkpoints; returns the exit code (the table above)."""
    import json

    from normvit_jax import logs
    logs.quiet_library_logs()
    logs.import_tensorflow_once()
    from normvit_jax import checkpoints, data, evaluation
    try:
        result = evaluation.evaluate_checkpoint(config, workdir, step)
    except (checkpoints.CheckpointMismatchError, FileNotFoundError) as e:
        return _stop(e, EXIT_CHECKPOINT)
    except (data.DatasetNotFoundError, ValueError) as e:
        return _stop(e, EXIT_CONFIG)
    print(json.dumps(result, sort_keys=True))
    return EXIT_OK


def _stop(error: BaseException, code: int) -> int:
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
                    return (f"Unknown config key --{key} (value {value!r}): "
                            f"{'.'.join(walked)} has no key {part!r}; accepted: {accepted}")
                node, walked = node[part], walked + [part]
    return f"Bad command line: {type(error).__name__}: {error}"
