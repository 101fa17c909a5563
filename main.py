"""Train and evaluate a ViT: ``python main.py --config=configs/vit_ln.py:demo --workdir=runs/demo``.

Every config value can be overridden: ``--config.batch_size=256 --config.model.norm.name=dtn``,
also inside dict-valued fields (``--config.model.norm_overrides.block_1.name=rmsnorm``) and to
None (``--config.model.variant=None``).
Re-running the same command with the same workdir continues the run from its newest checkpoint;
``--fresh`` starts over (the old run is moved aside). Exit codes: docs/faults.md (normvit_jax/cli.py).
``--mode=import --config=... --config.init_from=FILE`` writes a run of step 0 holding FILE's
model (timm / the methods' originals / a ViT .npz) without training, and evaluates it once
(``--skip_eval``: not): eval, predict, reparam, export take that workdir (docs/pretrained.md).
``--mode=eval [--step=N]`` evaluates a checkpoint without training (with the run's own config,
its workdir's config.json, unless ``--config`` is given), on any eval set:
``--config.data.eval_name=imagenet_v2 --config.data.eval_split=test`` (README: Evaluation).
``--mode=config`` prints the resolved config (variants and ``--config.*`` overrides applied, as
the run's config.json would hold it) as JSON and exits; nothing is trained or compiled, and no
``--workdir`` is needed (given alone, its run's own config.json is shown).
Multi-host (Cloud TPU pod, SLURM): run the same command on every host; JAX's distributed runtime
is initialised when the process is one of several.
"""
import os
import sys

# Before TensorFlow and jaxlib load: each prints the same oneDNN banner through its C++ INFO log.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from normvit_jax import cli, config_paths, reproducible, tool_flags  # noqa: E402

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/vit_ln.py:demo; or a "
                                "run's config.json or workdir (--mode=eval: the workdir's by default)",
                                lock_config=True)
flags.DEFINE_string("workdir", None, "Directory (local or gs://) for checkpoints, summaries, config.")
flags.DEFINE_bool("fresh", False, "Start at step 0 even if the workdir holds a run: its checkpoints, "
                  "config.json, event files and eval_*.json results are moved to "
                  "<workdir>/replaced/<time>/ first.")
flags.DEFINE_enum("mode", "train", ["train", "eval", "import", "config"], "train: train (and "
                  "evaluate); eval: only evaluate a checkpoint on config.data.eval_name/eval_split, "
                  "writing <workdir>/eval_<dataset>_<split>_<step>.json; import: write "
                  "config.init_from's model as the run's step-0 checkpoint, no training, and "
                  "evaluate it once; config: print the resolved config as JSON (as config.json "
                  "would hold it) and exit, no --workdir needed.")
flags.DEFINE_bool("skip_eval", False, "--mode=import: do not evaluate the imported model.")
flags.DEFINE_integer("step", None, "--mode=eval: the checkpoint's step (default: the newest).")
flags.mark_flags_as_required(["config"])  # --workdir: parse_flags requires it (not --mode=config)


RUN_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "run_config.py")


def _flag(argv, name):
    """The value of ``--name=V`` or ``--name V`` in argv (the last one), else None."""
    value = None
    for i, a in enumerate(argv):
        if a.startswith(f"--{name}="):
            value = a.split("=", 1)[1]
        elif a == f"--{name}" and i + 1 < len(argv):
            value = argv[i + 1]
    return value


def resolve_config_arg(argv):
    """--config as a run's config.json or its workdir (configs/run_config.py reads it), and
    --mode=eval without --config: the workdir's own config; anything else that is not a .py file
    is refused in one line."""
    spec = _flag(argv, "config")
    if spec is None:
        workdir = _flag(argv, "workdir")
        mode = _flag(argv, "mode")
        if mode in ("eval", "config") and workdir:
            if "://" not in workdir and not os.path.exists(os.path.join(workdir, "config.json")):
                from normvit_jax import run_config  # no JAX
                if run_config.has_checkpoint(workdir):
                    print(f"error: {run_config.missing_config(workdir)}", file=sys.stderr)
                    sys.exit(cli.EXIT_CONFIG)
                what = "to evaluate" if mode == "eval" else "whose config to show"
                print(f"error: {workdir} holds no run {what} (no config.json): train one there "
                      f"first, e.g. python main.py --config=configs/vit_ln.py:demo "
                      f"--workdir={workdir}", file=sys.stderr)
                sys.exit(cli.EXIT_CONFIG)
            # Before any --config.* override: absl refuses an override ahead of its --config.
            return argv[:1] + [f"--config={RUN_CONFIG}:{workdir}"] + argv[1:]
        return argv
    path = spec.split(":", 1)[0] if not spec.startswith("gs://") else spec
    if path.endswith(".py"):
        return argv
    if path.endswith(".json") or os.path.isdir(spec) or spec.startswith("gs://"):
        return [f"--config={RUN_CONFIG}:{spec}" if a == f"--config={spec}" else a for a in argv]
    print(f"error: --config={spec}: not a config; accepted: a config file configs/<name>.py[:variants], "
          "a run's config.json, or a run's workdir", file=sys.stderr)
    sys.exit(cli.EXIT_CONFIG)


def _require(argv, name, what):
    """One line and exit 2 for a missing required flag (absl's mark_flags_as_required raised
    'IllegalFlagValueError: flag --workdir=None: Flag --workdir must have a value other than
    None')."""
    if _flag(argv, name) is None:
        print(f"error: --{name} is required ({what})", file=sys.stderr)
        sys.exit(cli.EXIT_CONFIG)


def parse_flags(argv):
    """absl's parser, with a short message instead of a traceback for a bad --config override.
    Keys inside dict-valued fields (``--config.model.norm_overrides.block_1.name=rmsnorm``) and
    ``=None`` are set after it (normvit_jax/config_paths.py)."""
    tool_flags.absl_help(argv)  # before any check: --help needs no --config or --workdir
    show = _flag(argv, "mode") == "config"  # prints the config: no run's folder needed
    if not show:
        _require(argv, "workdir", "the run's folder: checkpoints, summaries, config.json; e.g. "
                 "--workdir=runs/demo")
    # --workdir=~/runs, --config.data.data_dir=~/tfds: ~ as the shell expands it after a space.
    argv = resolve_config_arg(tool_flags.expand_home(argv))
    _require(argv, "config", "a config file, e.g. --config=configs/vit_ln.py:demo, or a run's "
             "workdir; --mode=eval and --mode=config take the workdir's own by default")
    argv, paths = config_paths.split(argv)
    sys.argv = list(argv)  # config_flags reads the overrides from sys.argv
    try:
        rest = FLAGS(argv)
    except Exception as e:  # noqa: BLE001  (ml_collections raises several types)
        print(f"error: {cli.describe_flag_error(argv, e)}", file=sys.stderr)
        sys.exit(cli.EXIT_CONFIG)
    if (not show or FLAGS.workdir is not None) and not (FLAGS.workdir or "").strip():
        # --workdir=$UNSET: the run went into the current folder
        print("error: --workdir is empty (an unset shell variable?); pass the run's directory, "
              "e.g. --workdir=runs/demo", file=sys.stderr)
        sys.exit(cli.EXIT_CONFIG)
    try:
        config_paths.apply(FLAGS.config, paths)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(cli.EXIT_CONFIG)
    except Exception:  # noqa: BLE001  (the config file itself failed to load: reported at start)
        pass
    return rest


def _pin_cpu_numerics() -> None:
    """config.reproducible_cpu_threads, before JAX starts its backend (XLA reads its flags and
    thread count once). A config that does not load is reported by cli.run's preflight."""
    try:
        threads = int(FLAGS.config.reproducible_cpu_threads or 0)
    except Exception:  # noqa: BLE001
        return
    line = reproducible.apply(threads)
    if line:
        logging.info("%s", line)


def main(argv):
    if len(argv) > 1:  # one line and exit 2, as every tool (absl's UsageError exits 1 with usage)
        print(f"error: unexpected arguments {argv[1:]}: main.py takes only flags "
              "(--config=..., --workdir=..., --config.KEY=VALUE; --help lists them)", file=sys.stderr)
        sys.exit(cli.EXIT_CONFIG)
    # Flags of the other mode were ignored: --step=N with training still resumed from the newest
    # checkpoint, --fresh with --mode=eval moved nothing aside.
    wrong = ("--step" if FLAGS.mode != "eval" and FLAGS.step is not None else
             "--fresh" if FLAGS.mode in ("eval", "config") and FLAGS.fresh else
             "--skip_eval" if FLAGS.mode != "import" and FLAGS.skip_eval else None)
    if wrong:
        print(f"error: {wrong} is not a flag of --mode={FLAGS.mode}: --step chooses the checkpoint "
              "--mode=eval evaluates; training resumes from the newest checkpoint, and --fresh "
              "starts it over (or an import); --skip_eval is --mode=import's", file=sys.stderr)
        sys.exit(cli.EXIT_CONFIG)
    if FLAGS.mode == "config":  # no JAX backend, nothing compiled or written
        sys.exit(cli.show_config(FLAGS.config))
    try:
        _pin_cpu_numerics()
        if FLAGS.mode == "eval":
            sys.exit(cli.evaluate(FLAGS.config, FLAGS.workdir, step=FLAGS.step))
        if FLAGS.mode == "import":
            sys.exit(cli.import_checkpoint(FLAGS.config, FLAGS.workdir, fresh=FLAGS.fresh,
                                           evaluate=not FLAGS.skip_eval))
        sys.exit(cli.run(FLAGS.config, FLAGS.workdir, fresh=FLAGS.fresh))
    except KeyboardInterrupt:  # Ctrl-C outside the training loop (which saves first: preemption.py)
        print("interrupted (Ctrl-C) before training or during evaluation; nothing new was saved; "
              "rerun the same command to resume.", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
