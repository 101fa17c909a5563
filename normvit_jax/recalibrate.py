"""Re-estimates the running statistics of a trained run at its final weights (SLAB does this).

    python -m normvit_jax.recalibrate --workdir=runs/repbn --out=runs/repbn_recal [--batches=200]
                                      [--step=S] [--weights=raw|ema]
                                      [--config=configs/vit_repbn.py:demo]

BN-type running statistics (BatchNorm, RepBN, a progressive norm's N2, UN's running variance) are
averaged over the whole run while the weights move; this tool re-estimates them with the final
weights: ``--batches`` train-mode forwards (no backward) over the *training* split read like the
eval split (no augmentation: the eval transforms, no Mixup, no random erasing), at the train batch
size, with dropout and drop-path off, the global step that of the checkpoint (a progressive norm's
lam is then its final value). Each forward updates the statistics with the norm's own momentum, so
after N batches the checkpoint's statistics weigh momentum**N (0.9**200 ~ 7e-10). Statistics that
a norm updates in its backward pass (PowerNorm's ema_gz, UN's gz window) and the norms' step
counters (``t``) are left as they are.
Partial (padded) batches are skipped.

Writes a new workdir ``--out`` (config.json, the run's data.json and classes.json, and one
checkpoint at the same step: the whole train state with only ``batch_stats`` changed, readable by
``main.py --mode=eval``, predict, export and ``python -m normvit_jax.reparam``) and
``recalibrate.json`` there, and prints the eval metrics of the config's eval split before and
after. ``--weights=ema`` (a run with ``config.ema_decay > 0`` and ``config.ema_batch_stats``):
the statistics of the weight EMA are re-estimated at the EMA weights and written in the EMA's place
(the raw model is unchanged; the metrics printed are ``ema_*``, and predict/export/reparam
``--weights=ema`` on ``--out`` use them). ``--config``: a config file for the run (default: the run's config.json). Exit 2 with one
line for a run without running statistics or a bad flag.
"""
from __future__ import annotations

import json
import sys
from typing import Any, Sequence

import jax
import ml_collections
from etils import epath

from normvit_jax import checkpoints, data, models, predict, run_config, run_data, sharding
from normvit_jax.data import stats as data_stats
from normvit_jax.train import ema as ema_lib
from normvit_jax.train import optimizer as optim
from normvit_jax.train import setup
from normvit_jax.train import steps as steps_lib


def statistics_view(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The config of the statistics pass: the train split read as the eval split is (no
    augmentation), at the train batch size; dropout and drop-path off."""
    c = ml_collections.ConfigDict(config.to_dict())
    c.data.eval_split = config.data.train_split
    c.data.eval_name = None
    c.data.num_eval_examples = config.data.get("num_train_examples")
    c.eval_batch_size = config.batch_size
    c.model.dropout_rate = c.model.attention_dropout_rate = c.model.stochastic_depth = 0.0
    return c


def recalibrate_stats(model: Any, variables: dict, batches: Any, step: Any,
                      affine: Any = None, num_batches: int = 200,
                      progress: bool = False) -> tuple[dict, int]:
    """(new batch_stats, batches used): train-mode forwards of ``model`` over full batches of
    ``batches`` (dicts with 'image', 'mask'), each updating the running statistics; with
    ``progress``, a bar on stderr (cleared when done)."""
    from tqdm import tqdm
    kw = steps_lib.step_kwargs(model, step)

    @jax.jit
    def forward(bs, images):
        _, mutated = model.apply({"params": variables["params"], "batch_stats": bs}, images,
                                 train=True, mutable=["batch_stats", "schedule"], **kw)
        return mutated["batch_stats"]

    bs, used = variables["batch_stats"], 0
    with tqdm(total=num_batches, desc="recalibrating", unit="batch", file=sys.stderr,
              dynamic_ncols=True, leave=False, disable=not progress) as bar:
        for batch in batches:
            if used >= num_batches:
                break
            if not bool(batch["mask"].all()):  # a padded last batch would bias the statistics
                continue
            bs = forward(bs, data_stats.model_input(batch["image"], affine))
            used += 1
            bar.update(1)
    return _keep_step_counters(variables["batch_stats"], bs), used


# the norms' own step counters (PowerNorm's and UN's warmups, UN's gz window index): each forward
# advanced them, so --batches=200 left a step-4 checkpoint counting 204 steps, and a run continued
# from --out ended its warmups early
STEP_COUNTERS = ("t",)


def _keep_step_counters(old: Any, new: Any) -> Any:
    """``new`` statistics with the step counters of ``old`` (the checkpoint's step stays the run's)."""
    from flax import traverse_util
    flat_old = traverse_util.flatten_dict(dict(old))
    flat = traverse_util.flatten_dict(dict(new))
    for key in flat:
        if key[-1] in STEP_COUNTERS:
            flat[key] = flat_old[key]
    return traverse_util.unflatten_dict(flat)


def _fail(message: str) -> None:
    print(f"python -m normvit_jax.recalibrate: error: {message}", file=sys.stderr)
    sys.exit(2)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    from normvit_jax import cli, logs, tool_flags

    logs.quiet_library_logs()
    p = tool_flags.Parser("python -m normvit_jax.recalibrate", __doc__)
    p.add_argument("--workdir", required=True, help="run directory with checkpoints")
    p.add_argument("--out", required=True, help="new workdir for the recalibrated checkpoint")
    p.add_argument("--config", default=None, help="config file of the run (default: its config.json)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    tool_flags.add_weights(p)
    p.add_argument("--batches", type=int, default=200, help="train batches to average over")
    args = p.parse_args(argv)
    with cli.tool_errors(p.prog):  # docs/faults.md: one line and the table's exit code
        return _main(args)


def _main(args: Any) -> dict[str, Any]:
    from normvit_jax import cli, tool_flags
    if args.batches < 1:
        _fail(f"--batches={args.batches} is not accepted; accepted: a positive integer")
    # a file first: listing it as a folder was a NotADirectoryError traceback, exit 1
    tool_flags.check_output("out", args.out, folder=True)  # before the work
    if epath.Path(args.out).exists() and any(epath.Path(args.out).iterdir()):
        _fail(f"--out={args.out} exists and is not empty; accepted: a new or empty folder")
    config = (cli.load_config_file(args.config) if args.config
              else checkpoints.load_config(args.workdir))
    mesh = sharding.make_mesh(config)
    run_spec = setup.resolve_config(config, mesh.devices.size)  # as evaluation.evaluate_checkpoint
    record = run_data.read(args.workdir)  # the statistics the run trained with, if recorded
    ds = run_data.inference_spec(args.workdir, run_spec.data)
    model = setup.create_model(config, ds.num_classes, run_spec.model)
    eval_pipe = data.make_pipeline(config, "eval", ds)
    tx, _ = optim.create(config, max(int(config.total_steps or 0), 1))
    abstract, state_sharding = setup.abstract_train_state(model, tx, eval_pipe.image_shape, mesh,
                                                          sharding.fsdp_min_size(config))
    steps = checkpoints.complete_steps(args.workdir)
    if not steps or (args.step is not None and args.step not in steps):
        raise checkpoints.no_checkpoint(args.workdir, args.step, steps)
    mngr = checkpoints.open_read_only(args.workdir)
    try:  # the shared restore path: a damaged newest checkpoint is named, the previous one used
        restored = checkpoints.restore_latest(
            mngr, abstract, move_damaged=False, steps=None if args.step is None else [args.step],
            others=None if args.step is None else [s for s in steps if s != args.step])
    finally:
        mngr.close()
    state, step = restored.state, restored.step
    if not jax.tree.leaves(state.batch_stats):
        _fail(f"the model of {args.workdir} keeps no running statistics (norm "
              f"{config.model.norm.name!r}): nothing to recalibrate")
    averaged = ema_lib.averaged(state)  # the EMA model, None without one
    if args.weights == "ema":
        if averaged is None:
            raise checkpoints.no_ema(args.workdir)
        if not ema_lib.keeps_stats(state.opt_state):  # nowhere to keep them but the raw model's
            _fail(f"--weights=ema: the run {args.workdir} evaluates its EMA weights with the raw "
                  "statistics (config.ema_batch_stats=False); leave --weights out to re-estimate "
                  "those")
    elif averaged is not None and args.weights is None:
        checkpoints.note_raw_weights(args.workdir)
    ema = args.weights == "ema"
    prefix = "ema_" if ema else ""  # the metrics of the model recalibrated
    affine = ds.affine
    eval_step = setup.jit_eval_step(model, state_sharding, mesh, affine)
    before = setup.evaluate(eval_step, state, eval_pipe, mesh)
    stats_cfg = statistics_view(config)
    stats_ds = run_data.apply(setup.resolve_config(stats_cfg, mesh.devices.size).data, record)
    stats_pipe = data.make_pipeline(stats_cfg, "eval", stats_ds)
    stats_model = models.create(stats_cfg.model, ds.num_classes)
    new_bs, used = recalibrate_stats(stats_model, (averaged if ema else state).variables(),
                                     stats_pipe.eval_batches(),
                                     state.step, affine, args.batches, progress=True)
    stats_pipe.close()
    if used == 0:
        _fail(f"no full batch of {config.batch_size} in the train split: lower --config batch_size")
    new_state = (state.replace(opt_state=ema_lib.init_stats(state.opt_state, new_bs)) if ema
                 else state.replace(batch_stats=new_bs))
    after = setup.evaluate(eval_step, new_state, eval_pipe, mesh)
    eval_pipe.close()
    out = epath.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    checkpoints.config_path(args.out).write_text(config.to_json_best_effort(indent=2))
    # the new workdir normalizes as the run trained, with its class names, without the dataset
    run_config.write_json_atomic(args.out, run_data.RECORD_NAME, record or run_data.of_spec(ds))
    names = predict.run_class_names(args.workdir, config)
    if names:
        run_config.write_json_atomic(args.out, "classes.json", names)
    saver = checkpoints.make_manager(args.out, async_save=False)
    checkpoints.save(saver, int(step), new_state)
    saver.wait_until_finished()
    saver.close()
    result = {"workdir": args.workdir, "step": int(step), "batches": used,
              "batch_size": int(config.batch_size), "before": before, "after": after,
              "weights": "ema" if ema else "raw"}
    (out / "recalibrate.json").write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    for name, m in (("before", before), ("after", after)):
        print(f"{name}{' (EMA weights)' if ema else ''}: top-1 {m[prefix + 'top1']:.4f}, top-5 "
              f"{m[prefix + 'top5']:.4f}, loss {m[prefix + 'loss']:.4f} over "
              f"{m['num_examples']} examples")
    print(f"statistics re-estimated over {used} train batches of {config.batch_size}; "
          f"checkpoint of step {step} written to {args.out}")
    return result


if __name__ == "__main__":
    from normvit_jax import logs as _logs  # absl's log format, as main.py's
    _logs.absl_format()
    main()
