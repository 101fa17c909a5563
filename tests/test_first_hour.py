"""A new user's first hour (issue 15): every documented config field can be set on the command
line, failed starts leave nothing behind, bad values are refused with exit 2, and the log says
what it means once."""
from __future__ import annotations

import datetime
import glob
import json
import os
import re
import subprocess
import sys

import ml_collections
import numpy as np
import pytest
from absl import flags
from ml_collections import config_flags

from configs import default
from normvit_jax import cli, preflight, pretrained, run_config, workdir
from normvit_jax.train import setup
from tests import conftest
from tests.conftest import REPO_ROOT

CONFIG_FILES = sorted(os.path.basename(p) for p in glob.glob(os.path.join(REPO_ROOT, "configs", "*.py"))
                      if not p.endswith("default.py") and "def get_config(" in open(p).read())
# model.norm is a dict of options (its `name` is set instead); model.norm_overrides starts empty:
# its keys name blocks (set by path: tests/test_config_paths.py).
NOT_LEAVES = ("model.norm_overrides",)


def _leaves(c: ml_collections.ConfigDict, prefix: str = "") -> list[str]:
    out = []
    for k in c.keys():
        key = f"{prefix}{k}"
        if isinstance(c[k], ml_collections.ConfigDict):
            if key not in NOT_LEAVES:
                out += _leaves(c[k], key + ".")
        else:
            out.append(key)
    return out


def _value_for(field_type: type) -> tuple[str, object]:
    """A command-line string for a field of this type and the value it must parse to."""
    return {int: ("7", 7), float: ("0.25", 0.25), bool: ("True", True),
            str: ("some/value", "some/value")}[field_type]


def _parse(spec: str, argv_tail: list[str]) -> ml_collections.ConfigDict:
    """main.py's parser (config_flags reads the override names from sys.argv)."""
    fv = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, "", flag_values=fv, lock_config=True)
    argv = ["main.py", f"--config={spec}"] + argv_tail
    saved, sys.argv = sys.argv, argv
    try:
        fv(argv)
    finally:
        sys.argv = saved
    return fv.config


def _get(c, key):
    for part in key.split("."):
        c = c[part]
    return c


DEFAULT_FIELDS = _leaves(default.get_config())
# a run's saved config.json for configs/run_config.py: the demo's, as the loop writes it
_SAVED_RUN = os.path.join(__import__("tempfile").mkdtemp(prefix="saved_run"), "config.json")
with open(_SAVED_RUN, "w") as _f:
    _f.write(conftest.tiny_demo_config().to_json_best_effort())


def test_default_fields_are_all_typed():
    """A field whose default is a bare None cannot be set from the command line at all."""
    c = default.get_config()
    untyped = [k for k in DEFAULT_FIELDS if _get(c, k) is None and _field_type(c, k) is type(None)]
    assert not untyped, untyped
    assert len(DEFAULT_FIELDS) > 60  # the walk reached every section


def _field_type(c, key):
    *path, last = key.split(".")
    for p in path:
        c = c[p]
    return c.get_type(last)


@pytest.mark.parametrize("config_file", CONFIG_FILES)
def test_every_documented_field_is_settable_from_the_command_line(config_file):
    variants = {"finetune_cifar.py": ["", ":b32,cifar100"], "finetune.py": ["", ":b32"],
                "ln_counterpart.py": [":dtn", ":dtn,demo"],
                "run_config.py": [f":{_SAVED_RUN}"]}.get(config_file, ["", ":demo"])
    base_types = {k: _field_type(default.get_config(), k) for k in DEFAULT_FIELDS}
    for variant in variants:
        spec = os.path.join(REPO_ROOT, "configs", config_file) + variant
        argv, expected = [], {}
        for key in DEFAULT_FIELDS:
            text, value = _value_for(base_types[key])
            argv.append(f"--config.{key}={text}")
            expected[key] = value
        config = _parse(spec, argv)  # raised UnsupportedOperationError for None-typed fields
        for key, value in expected.items():
            assert _get(config, key) == value, (spec, key)
        # the norm's own options stay settable too (its name is the documented switch)
        config = _parse(spec, ["--config.model.norm.name=rmsnorm"])
        assert config.model.norm.name == "rmsnorm"


# ------------------------------------------------------------------ failed starts, exit codes

TINY = ["--config.model.hidden_size=16", "--config.model.depth=1", "--config.model.num_heads=2",
        "--config.model.mlp_dim=16", "--config.batch_size=32", "--config.eval_batch_size=128",
        "--config.total_steps=2", "--config.log_every=1", "--config.eval_every=2",
        "--config.checkpoint_every=2", "--config.eval_analysis_images=0"]
NO_GCS = {"GOOGLE_APPLICATION_CREDENTIALS": "", "GCE_METADATA_HOST": "127.0.0.1:9"}


def main_py(*args: str, env: dict | None = None, cwd: str = REPO_ROOT,
            timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(REPO_ROOT, "main.py"), *args], cwd=cwd,
                          env={**os.environ, "PYTHONPATH": REPO_ROOT, **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


def _messages(r: subprocess.CompletedProcess) -> list[str]:
    """The log lines of a run that stopped (absl's 'E... ] Stopped: ...')."""
    return [line for line in (r.stdout + r.stderr).splitlines() if "Stopped:" in line]


def test_missing_config_file_exits_2_and_creates_nothing(tmp_path):
    wd = tmp_path / "wd"
    r = main_py("--config=configs/no_such_file.py:demo", f"--workdir={wd}", cwd=str(tmp_path))
    assert r.returncode == cli.EXIT_CONFIG, r.stderr[-3000:]
    stopped = _messages(r)
    assert len(stopped) == 1 and "no_such_file.py" in stopped[0] and "No such file" in stopped[0]
    assert "Traceback" not in r.stderr
    assert os.listdir(tmp_path) == []  # no workdir, no lock


@pytest.mark.parametrize("override,key", [
    ("--config.total_steps=0", "total_steps"), ("--config.total_steps=-5", "total_steps"),
    ("--config.num_epochs=-1", "num_epochs"), ("--config.num_epochs=0", "num_epochs")])
def test_run_length_is_validated(tmp_path, override, key):
    r = main_py("--config=configs/vit_ln.py:demo", override, f"--workdir={tmp_path}/wd")
    assert r.returncode == cli.EXIT_CONFIG, r.stderr[-3000:]
    assert f"config.{key}=" in r.stderr
    assert not (tmp_path / "wd").exists()
    config = conftest.tiny_demo_config()  # the loop's own validation says the same
    config[key] = int(override.split("=")[1]) if key == "total_steps" else float(override.split("=")[1])
    with pytest.raises(ValueError, match=f"config.{key}="):
        setup.validate_config(config, 1)


def test_gs_weights_without_credentials_fail_fast_with_exit_5(tmp_path):
    """finetune_cifar.py's default weights are on gs://: no 48-line TensorFlow traceback."""
    r = main_py("--config=configs/finetune_cifar.py:b16", f"--workdir={tmp_path}/wd",
                env={**NO_GCS, "CLOUDSDK_CONFIG": str(tmp_path / "gcloud")}, timeout=60)
    assert r.returncode == cli.EXIT_WORKDIR, r.stderr[-3000:]
    assert re.search(r"config.init_from gs://vit_models/imagenet21k/ViT-B_16.npz: no Google Cloud "
                     r"credentials found .*gcloud auth application-default login", r.stderr)
    # the bucket is public: the line also says how to do without credentials
    assert ("Or download the public file, `wget https://storage.googleapis.com/vit_models/"
            "imagenet21k/ViT-B_16.npz`, and pass its local path: "
            "--config.init_from=ViT-B_16.npz.") in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "wd").exists()


def test_init_from_that_is_not_an_npz_is_named(tmp_path):
    junk = tmp_path / "weights.npz"
    junk.write_bytes(np.random.default_rng(0).bytes(4096))
    r = main_py("--config=configs/vit_ln.py:demo", f"--config.init_from={junk}",
                f"--workdir={tmp_path}/wd")
    assert r.returncode == cli.EXIT_CONFIG, r.stderr[-3000:]
    assert "not an .npz archive" in r.stderr and "pickle" not in r.stderr
    assert not (tmp_path / "wd").exists()
    with pytest.raises(pretrained.CheckpointError, match="not an .npz archive"):
        pretrained.load_npz(str(junk))  # the loader says the same
    missing = main_py("--config=configs/vit_ln.py:demo", f"--config.init_from={tmp_path}/nope.npz",
                      f"--workdir={tmp_path}/wd")
    assert missing.returncode == cli.EXIT_CONFIG and "does not exist" in missing.stderr
    # ... and says where the README's `--config.init_from=ViT-B_16.npz` comes from
    assert "wget https://storage.googleapis.com/vit_models/imagenet21k/ViT-B_16.npz" in missing.stderr
    assert "docs/pretrained.md" in missing.stderr
    assert not (tmp_path / "wd").exists()


def test_workdir_that_is_a_file_is_named(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    r = main_py("--config=configs/vit_ln.py:demo", f"--workdir={f}")
    assert r.returncode == cli.EXIT_WORKDIR
    assert "is a file, not a directory" in r.stderr and "ermission" not in r.stderr
    r = main_py("--config=configs/vit_ln.py:demo", f"--workdir={f}/sub")
    assert r.returncode == cli.EXIT_WORKDIR and "is a file, not a directory" in r.stderr


@pytest.mark.parametrize("workdir", ["", " "])
def test_an_empty_workdir_is_refused_and_nothing_is_written(tmp_path, workdir):
    """--workdir=$UNSET trained a whole run into the current folder (checkpoints/, config.json,
    .lock, event files beside the user's files) with exit 0."""
    for mode in ("train", "eval"):
        r = main_py(f"--config={REPO_ROOT}/configs/vit_ln.py:demo", f"--workdir={workdir}",
                    f"--mode={mode}", "--config.total_steps=1", cwd=str(tmp_path))
        assert r.returncode == cli.EXIT_CONFIG and "Traceback" not in r.stderr, r.stderr[-3000:]
        assert r.stderr.strip().splitlines() == [
            "error: --workdir is empty (an unset shell variable?); pass the run's directory, "
            "e.g. --workdir=runs/demo"]
        assert os.listdir(tmp_path) == []
    with pytest.raises(ValueError, match="the workdir is empty"):  # cli.run called directly
        preflight.check(conftest.tiny_demo_config(), workdir)


@pytest.mark.parametrize("args, flag", [
    (["--config=configs/vit_ln.py:demo"], "--workdir"),
    (["--workdir=WD"], "--config"),
])
def test_a_missing_required_flag_is_one_line_exit_2(tmp_path, args, flag):
    """Without --workdir absl said 'IllegalFlagValueError: flag --workdir=None: Flag --workdir
    must have a value other than None'."""
    r = main_py(*[a.replace("WD", str(tmp_path / "wd")) for a in args])
    assert r.returncode == cli.EXIT_CONFIG, r.stderr[-3000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {flag} is required ("), lines
    assert not (tmp_path / "wd").exists()


def test_config_of_a_workdir_without_checkpoint_can_change(tmp_path):
    """A start that failed before its first checkpoint does not lock in its config."""
    a = conftest.tiny_demo_config()
    b = conftest.tiny_demo_config(**{"optimizer.learning_rate": 0.01})
    run_config.write_config(a, str(tmp_path))
    run_config.check_config(b, str(tmp_path))  # no checkpoint: accepted
    run_config.write_config(b, str(tmp_path))
    before = glob.glob(str(tmp_path / "config.before-*.json"))
    assert len(before) == 1 and json.load(open(before[0]))["optimizer"]["learning_rate"] == 0.003
    assert json.load(open(tmp_path / "config.json"))["optimizer"]["learning_rate"] == 0.01
    (tmp_path / "checkpoints" / "2").mkdir(parents=True)  # once trained, a change is refused
    with pytest.raises(run_config.ConfigChangedError, match="learning_rate: 0.01 -> 0.003"):
        run_config.check_config(a, str(tmp_path))


def test_keys_added_since_a_run_are_no_change_at_their_default():
    """A config.json written before a key existed (e.g. ema_decay) still matches a config that
    leaves the key at its default; set to another value, the key is a change."""
    saved = {"optimizer": {"learning_rate": 0.003}, "batch_size": 8}
    defaults = {"ema_decay": 0.0, "data.repeated_aug": 1}
    same = {"optimizer": {"learning_rate": 0.003}, "batch_size": 8, "ema_decay": 0.0,
            "data": {"repeated_aug": 1}}
    assert run_config.config_diff(saved, same, defaults) == []
    other = dict(same, ema_decay=0.999)
    assert run_config.config_diff(saved, other, defaults) == ["ema_decay: '<absent>' -> 0.999"]
    # a key missing from the defaults (a method's own key) stays a change when absent before
    assert run_config.config_diff(saved, dict(same, extra=1), defaults) == ["extra: '<absent>' -> 1"]
    # the real defaults: an old config.json without the recipe keys matches today's config
    cfg = conftest.tiny_demo_config()
    old = json.loads(cfg.to_json_best_effort())
    for k in ("ema_decay", "mixup_alpha", "layer_decay"):
        old.pop(k)
    assert run_config.config_diff(old, json.loads(cfg.to_json_best_effort())) == []


def test_failed_init_from_does_not_lock_in_its_config(tmp_path):
    """End to end: weights that do not fit fail before config.json is written (the new workdir
    is removed: tests/test_pretrained.py); the corrected command is accepted by the workdir
    checks (the training itself is tested elsewhere)."""
    bad = tmp_path / "other.npz"
    np.savez(bad, unrelated=np.zeros(3, np.float32))
    r = main_py("--config=configs/vit_ln.py:demo", *TINY, f"--config.init_from={bad}",
                f"--workdir={tmp_path}/wd")
    assert r.returncode == cli.EXIT_CONFIG, r.stderr[-3000:]
    assert not (tmp_path / "wd").exists()
    corrected = conftest.tiny_demo_config()
    with workdir.prepare(corrected, str(tmp_path / "wd")):  # used to raise ConfigChangedError
        pass


# ------------------------------------------------------------------ report and reparam


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One tiny main.py run (2 steps; model.variant set and every size overridden), shared by the
    tests that read its log or its workdir."""
    wd = tmp_path_factory.mktemp("tiny") / "wd"
    r = main_py("--config=configs/vit_ln.py:demo", *TINY, "--config.model.variant=S/16",
                f"--workdir={wd}")
    assert r.returncode == 0, r.stderr[-3000:]
    return r, wd


def test_report_skips_a_failed_run_and_says_so(tiny_run, tmp_path, capsys):
    from normvit_jax.analysis import report
    good = tiny_run[1]
    failed = tmp_path / "failed"  # ended before its first checkpoint
    failed.mkdir()
    (failed / "config.json").write_text((good / "config.json").read_text())
    never = tmp_path / "never"
    rc = report.main([str(good), str(failed), str(never), f"--out={tmp_path}/rep", "--no_attention"])
    assert rc == 0
    err = capsys.readouterr().err
    assert f"skipping {failed}" in err and f"skipping {never}: {never} does not exist: train" in err
    md = (tmp_path / "rep" / "report.md").read_text()
    assert f"- skipped {failed}: " in md and f"- skipped {never}: " in md
    rows = json.load(open(tmp_path / "rep" / "report.json"))
    assert [r["workdir"] for r in rows] == [str(good)]
    assert report.main([str(never), f"--out={tmp_path}/rep2", "--no_attention"]) == 2
    err = capsys.readouterr().err.strip().splitlines()  # one line naming it and the command
    assert err == [f"error: no run could be read: {never}: {never} does not exist: train a run "
                   f"there first, e.g. python main.py --config=configs/vit_ln.py:demo "
                   f"--workdir={never}"]


def test_reparam_timing_reports_the_spread_and_no_ratio_when_nothing_folded():
    from normvit_jax import reparam
    nothing = reparam.timing_summary([0.010, 0.012, 0.011], None, 64)
    assert "no speed ratio" in nothing and "x as fast" not in nothing
    assert "min 10.0, max 12.0" in nothing
    noise = reparam.timing_summary([0.010, 0.013, 0.011], [0.009, 0.0105, 0.012], 64)
    assert "no measurable difference" in noise and "x as fast" not in noise
    faster = reparam.timing_summary([0.020, 0.021, 0.022], [0.010, 0.0105, 0.011], 64)
    assert "folded 2.00x as fast" in faster


def test_reparam_help_points_to_an_existing_doc(capsys):
    from normvit_jax import reparam
    with pytest.raises(SystemExit):
        reparam.main(["--help"])
    out = capsys.readouterr().out
    assert "NORMS.md" not in out and "docs/norms.md" in out
    assert os.path.exists(os.path.join(REPO_ROOT, "docs", "norms.md"))


# ------------------------------------------------------------------ log noise, ETA, titles


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_eta_leaves_out_compilation_and_evals():
    """100 steps at 0.1 s each, 20 s of compilation before step 10 and a 30 s eval at step 50:
    the estimate is the true remaining train time at every log step, before and after the eval."""
    from normvit_jax.train import progress
    clock = FakeClock()
    eta = progress.Eta(100, clock=clock)
    clock.t = 20.0 + 10 * 0.1          # compile + the first 10 steps
    eta.mark(10)
    assert eta.remaining_s(10) is None and eta.describe(10) == "estimating"
    for step in range(20, 101, 10):
        clock.t += 10 * 0.1
        eta.mark(step)
        assert eta.remaining_s(step) == pytest.approx((100 - step) * 0.1, rel=1e-9), step
        assert eta.interval_steps_per_s() == pytest.approx(10.0)
        if step == 50:
            with eta.paused():
                clock.t += 30.0       # an eval: no effect on the rate
    assert eta.describe(100) == "0m00s"
    assert progress.fmt_time(3725) == "1h02m05s" and progress.fmt_time(65) == "1m05s"


def test_eta_counts_the_evals_and_checkpoint_writes_to_come():
    """The walker's run (evals and saves every 10 steps, a log line every 5) ended 60% later than
    its ETA said: the estimate is the wall time left, the evals and writes to come included at
    their measured means (the first, which compiles, left out once a second is measured), and says
    which pauses it cannot price yet. Simulated in the loop's order: step, log, eval, save."""
    from normvit_jax.train import progress
    clock = FakeClock()
    total, step_s, eval_s, save_s = 100, 0.1, 2.0, 0.5
    eta = progress.Eta(total, clock=clock, eval_every=10, checkpoint_every=10)
    assert [progress.events_left(s, total, 10) for s in (1, 10, 11, 100)] == [10, 10, 9, 1]
    assert progress.events_left(1, 95, 10) == 10 and progress.events_left(95, 95, 10) == 1
    assert progress.events_left(0, total, 10) == 10  # step 0 (a log before any step) as step 1
    clock.t = 7.0                      # compilation
    seen = {}
    for step in range(1, total + 1):
        clock.t += step_s
        if step % 5 == 0:
            eta.mark(step)
            seen[step] = (clock.t, eta.remaining_s(step), eta.describe(step))
        if step % 10 == 0:
            with eta.paused("eval"):
                clock.t += eval_s + (3.0 if step == 10 else 0.0)  # the first eval compiles
            with eta.paused("save"):
                clock.t += save_s
    end = clock.t
    assert seen[5][2] == "estimating"
    assert seen[10][2] == "0m09s + evals and checkpoints"   # 90 steps, no pause measured yet
    # one eval and one write measured, the eval with its compilation: not yet priced (the first
    # alone times the 9 left said 0m27s more than they took)
    assert seen[15][2] == progress.fmt_time(85 * step_s) + " + evals and checkpoints"
    for step in range(25, total + 1, 5):  # two of each measured: the estimate is exact
        t, left, _ = seen[step]
        assert left == pytest.approx(end - t, rel=1e-9), step
    assert seen[100][2] == "0m02s" and seen[50][2] == progress.fmt_time(end - seen[50][0])
    assert eta.interval_steps_per_s() == pytest.approx(10.0)  # training throughput, pauses out
    assert eta.wall_time_line() == ("Wall time 0m45s: training 0m17s (compilation included), "
                                    "evaluations 0m23s (10), checkpoint writes 0m05s (10).")


def test_model_line_says_the_sizes_built():
    from normvit_jax import models
    from normvit_jax.train import progress
    b16 = models.spec_of({"variant": "B/16"})
    assert progress.describe_model(b16) == "ViT-B/16 (depth 12, width 768, 12 heads, MLP 3072, patch 16)"
    small = models.spec_of({"variant": "B/16", "depth": 4, "hidden_size": 96})
    assert progress.describe_model(small) == ("ViT (depth 4, width 96, 12 heads, MLP 3072, patch 16; "
                                              "model.variant B/16 with depth, hidden_size overridden)")


def test_library_log_filter():
    import logging as std_logging
    from normvit_jax import logs

    def record(path, level, msg):
        return std_logging.LogRecord("absl", level, path, 1, msg, (), None)

    f = logs.QuietLibraries()
    orbax = "/x/site-packages/orbax/checkpoint/_src/metadata/checkpoint.py"
    assert not f.filter(record(orbax, std_logging.INFO, "Restoring item"))
    assert not f.filter(record(orbax, std_logging.WARNING, "Metadata file does not exist: %s"))
    assert f.filter(record(orbax, std_logging.WARNING, "Something else went wrong"))
    assert f.filter(record("/x/normvit_jax/train/loop.py", std_logging.INFO, "step 1/2"))


@pytest.mark.parametrize("code", [
    "from normvit_jax import logs; logs.import_tensorflow_once()",
    # the SavedModel export and runtime (the banner showed twice in `export --format=savedmodel`)
    "from normvit_jax.deploy import errors; errors.require('tensorflow', 'the savedmodel format')"])
def test_tensorflow_banner_printed_once(code):
    r = subprocess.run([sys.executable, "-c", code],
                       cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": REPO_ROOT, "TF_CPP_MIN_LOG_LEVEL": "0"},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0
    assert r.stderr.count("oneDNN custom operations") <= 1
    assert r.stderr.count("before absl::InitializeLog") <= 1


def test_tensorflow_starts_without_keras_and_tf_keras_still_loads():
    """TF's __init__ imports Keras's optimizers eagerly (40% of its start); the project's import
    skips that, and tf.keras still loads in full on first use."""
    code = ("import sys; from normvit_jax import logs; logs.import_tensorflow_once(); "
            "assert 'tensorflow.python.data' in sys.modules; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'keras')); "
            "import tensorflow as tf; print(type(tf.keras.optimizers.Adam()).__module__)")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT,
                       env={**os.environ, "PYTHONPATH": REPO_ROOT}, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.splitlines() == ["[]", "keras.src.optimizers.adam"]


def test_long_title_on_a_one_head_figure_fits():
    from normvit_jax.analysis import plots_attention
    title = ("Attention matrix of block 3 in run demo_dtn_with_a_long_name (step 880), the "
             "class token and 16 patches, head 0 only")
    fig = plots_attention.matrix_figure([np.eye(17) / 17], [0], 1, title)
    fig.canvas.draw()
    box = fig._suptitle.get_window_extent()
    width = fig.get_figwidth() * fig.dpi
    assert box.x0 >= 0 and box.x1 <= width, (box, width)
    assert "\n" in fig._suptitle.get_text()


def test_tiny_run_logs_each_thing_once(tiny_run):
    log = tiny_run[0].stderr
    assert log.count("oneDNN custom operations") <= 1
    assert "Model: ViT (depth 1, width 16, 2 heads, MLP 16, patch 2; model.variant S/16 with" in log
    assert log.count("step 2/2:") == 1 and "train/loss" not in log  # no CLU LoggingWriter copy
    assert "hparams" not in log.lower() and max(len(line) for line in log.splitlines()) < 400
    assert "Setting work unit notes" not in log


# ------------------------------------------------------------------ README's demo table


def test_demo_table_reruns_one_method_and_rewrites_its_row(tmp_path):
    from benchmarks import demo_table
    readme = tmp_path / "README.md"
    original = open(os.path.join(REPO_ROOT, "README.md")).read()
    readme.write_text(original)
    results = tmp_path / "demo_results.json"
    rc = demo_table.main(["--only=ln", "--seeds=2", f"--readme={readme}",
                          f"--root={tmp_path}/runs", f"--results={results}", *TINY])
    assert rc == 0
    text = readme.read_text()
    top1, top5 = demo_table.last_eval(str(tmp_path / "runs" / "ln"))
    rows = [line for line in text.splitlines() if line.startswith("| LayerNorm |")]
    seed1 = demo_table.last_eval(str(tmp_path / "runs" / "ln_seed1"))[0]
    span = f"{100 * min(top1, seed1):.2f}-{100 * max(top1, seed1):.2f}% (2)"
    assert len(rows) == 1 and rows[0].startswith(
        f"| LayerNorm | `vit_ln.py:demo` | {100 * top1:.2f}% | {span} | {100 * top5:.2f}% | ")
    assert re.fullmatch(r".* \| \d+ s \| \d+ s \|", rows[0])  # wall, then CPU seconds
    # every other row and everything outside the markers is unchanged
    untouched = [line for line in original.splitlines() if not line.startswith("| LayerNorm |")
                 and "Measured on this machine on" not in line]
    assert [line for line in text.splitlines() if not line.startswith("| LayerNorm |")
            and "Measured on this machine on" not in line] == untouched
    assert f"Measured on this machine on {datetime.date.today()}" in text
    kept = json.loads(results.read_text())["methods"]  # the row comes from the results file
    assert list(kept) == ["ln"] and kept["ln"]["top1"] == top1 and kept["ln"]["steps"] == 2
    assert kept["ln"]["top1_seeds"] == [top1, seed1] and kept["ln"]["cpu_s"] > 0
    assert kept["ln"]["command"].startswith("python main.py --config=configs/vit_ln.py:demo")
    assert kept["ln"]["machine"]["cores"] == os.cpu_count() and kept["ln"]["machine"]["versions"]
    with pytest.raises(ValueError, match="demo-table:begin"):
        demo_table.rewrite("no markers here", {})


def test_resumed_run_does_not_need_its_init_from(tmp_path):
    """init_from is read at step 0 only: a run with checkpoints resumes after the file is gone."""
    from normvit_jax import preflight
    config = conftest.tiny_demo_config(init_from=str(tmp_path / "gone.npz"))
    with pytest.raises(ValueError, match="does not exist"):
        preflight.check(config, str(tmp_path / "wd"))
    (tmp_path / "wd" / "checkpoints" / "6").mkdir(parents=True)
    preflight.check(config, str(tmp_path / "wd"))


@pytest.mark.parametrize("flags, wrong", [(["--mode=train", "--step=3"], "--step"),
                                          (["--mode=eval", "--fresh"], "--fresh"),
                                          (["--mode=import", "--step=3"], "--step"),
                                          (["--mode=train", "--skip_eval"], "--skip_eval")])
def test_a_flag_of_the_other_mode_is_refused(tmp_path, flags, wrong):
    """--step=3 with training was ignored (the run resumed from its newest checkpoint, or trained
    from step 0, exit 0); --fresh with --mode=eval evaluated the old run without a word."""
    r = main_py("--config=configs/vit_ln.py:demo", f"--workdir={tmp_path}/wd", *flags,
                "--config.total_steps=1")
    assert r.returncode == cli.EXIT_CONFIG and "Traceback" not in r.stderr, r.stderr[-3000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {wrong} is not a flag of "), lines
    assert not (tmp_path / "wd").exists()


@pytest.mark.parametrize("key", ["init_from", "data.data_dir"])
def test_an_empty_path_key_is_refused(tmp_path, key):
    """--config.init_from=$UNSET trained from scratch (an empty path read as 'none'), exit 0,
    when the user meant to fine-tune."""
    r = main_py("--config=configs/vit_ln.py:demo", f"--workdir={tmp_path}/wd",
                f"--config.{key}=", "--config.total_steps=1")
    assert r.returncode == cli.EXIT_CONFIG and "Traceback" not in r.stderr, r.stderr[-3000:]
    stopped = _messages(r)
    assert len(stopped) == 1 and f"config.{key} is empty (an unset shell variable?)" in stopped[0]
    assert not (tmp_path / "wd").exists()
