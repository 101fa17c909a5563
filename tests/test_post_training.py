"""Issue 28, points 4 and 7: evaluation and the post-training tools take the run's own config
from its workdir; a missing workdir, config or checkpoint is one line naming what is missing and
the command that makes it (checkpoints.RunNotFoundError), exit 2."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from normvit_jax import checkpoints, cli
from normvit_jax.analysis import capture
from tests.conftest import REPO_ROOT, compile_cache_env, tiny_demo_config
from tests.deploy_runs import XLA_FAST

# The children's environment: XLA's backend optimizations off (tests/deploy_runs.XLA_FAST) and one
# JAX compilation cache shared by this module's runs (the evals compile the same programs).
_ENV: dict = {}


@pytest.fixture(scope="module", autouse=True)
def _subprocess_env(tmp_path_factory):
    _ENV.clear()
    _ENV.update(os.environ, PYTHONPATH=REPO_ROOT, TF_CPP_MIN_LOG_LEVEL="2", XLA_FLAGS=XLA_FAST,
                **compile_cache_env(tmp_path_factory.mktemp("jax_cache")))


def test_missing_workdir_config_and_checkpoint_are_named_with_the_command(tmp_path):
    gone = tmp_path / "gone"
    with pytest.raises(checkpoints.RunNotFoundError,
                       match=rf"^{gone} does not exist: train a run there first, e\.g\. python "
                             rf"main\.py --config=configs/vit_ln\.py:demo --workdir={gone}$"):
        checkpoints.load_state(str(gone))
    with pytest.raises(checkpoints.RunNotFoundError, match=r"holds no run \(no config\.json\)"):
        capture.latest_step(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"seed": 0}))
    for call in (lambda: checkpoints.load_params(str(tmp_path)),
                 lambda: capture.latest_step(str(tmp_path))):
        with pytest.raises(checkpoints.RunNotFoundError, match=(
                rf"^no checkpoint in {tmp_path}/checkpoints: the run has not saved one yet; "
                rf"continue it with the command that started it \(same --workdir; its config is "
                rf"{tmp_path}/config\.json\)")):
            call()
    (tmp_path / "checkpoints" / "6").mkdir(parents=True)
    (tmp_path / "checkpoints" / "9.orbax-checkpoint-tmp").mkdir()  # half-written: not a step
    with pytest.raises(checkpoints.RunNotFoundError,
                       match=r"no checkpoint of step 9 in \S+; there are: \[6\]"):
        checkpoints.load_state(str(tmp_path), 9)
    assert capture.latest_step(str(tmp_path)) == 6


def test_a_damaged_config_json_is_named_by_every_reader(tmp_path):
    """Training, --mode=eval and the tools said only JSON's 'Unterminated string starting at: line
    1 column 10 (char 9)', naming no file."""
    from configs import run_config as run_config_file
    from normvit_jax import run_config
    path = tmp_path / "config.json"
    path.write_text('{"seed": "0')
    (tmp_path / "checkpoints" / "6").mkdir(parents=True)
    message = (rf"^{path} is not readable JSON \(Unterminated string .*\); restore the file \(a "
               r"config\.before-\*\.json beside it is an older copy\) or use another --workdir$")
    for read in (lambda: checkpoints.load_config(str(tmp_path)),  # the tools, main.py's eval
                 lambda: run_config_file.get_config(str(tmp_path)),  # --config=W
                 lambda: run_config.check_config(tiny_demo_config(), str(tmp_path))):  # training
        with pytest.raises(ValueError, match=message):
            read()


def test_a_damaged_classes_json_or_prepare_json_is_named(tmp_path):
    from normvit_jax import predict
    from normvit_jax.data import prepared
    (tmp_path / "classes.json").write_text('["cat", "do')
    with pytest.raises(ValueError, match=rf"^{tmp_path}/classes\.json is not readable JSON \(.*\); "
                                         r"restore it, or delete it to use the dataset's class"):
        predict.run_class_names(str(tmp_path), None)
    for other in ("5", '{"cat": 0}'):  # valid JSON, not a list: a TypeError, or the keys used
        (tmp_path / "classes.json").write_text(other)
        with pytest.raises(ValueError, match=r"classes\.json is not a list of class names"):
            predict.run_class_names(str(tmp_path), None)
    info = tmp_path / "dd" / "mine" / prepared.VERSION / prepared.INFO_FILE
    info.parent.mkdir(parents=True)
    info.write_text('{"classes": [')
    with pytest.raises(ValueError, match=rf"^{info} is not readable JSON \(.*\); prepare the "
                                         r"dataset again: python -m normvit_jax\.data\.prepare "
                                         rf"--src=YOUR_DATA --name=mine --data_dir={tmp_path}/dd "
                                         r"--overwrite$"):
        prepared.describe("mine", str(tmp_path / "dd"))




def _main(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "main.py", *args], cwd=REPO_ROOT, timeout=timeout,
                          env=_ENV,
                          capture_output=True, text=True)


def _one_line(r: subprocess.CompletedProcess, start: str) -> str:
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    lines = [line for line in r.stderr.splitlines() if line.startswith(start)]
    assert len(lines) == 1, r.stderr[-3000:]
    return lines[0]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> str:
    """One tiny trained run (6 steps, checkpoints 3 and 6) shared by the tests below."""
    wd = str(tmp_path_factory.mktemp("run") / "wd")
    r = _main("--config=tests/fault_config.py", "--config.total_steps=6",
              "--config.checkpoint_every=3", "--config.eval_every=6", f"--workdir={wd}")
    assert r.returncode == cli.EXIT_OK, r.stderr[-3000:]
    return wd


def test_eval_takes_the_runs_own_config_by_default_or_as_config_json(run):
    r = _main("--mode=eval", f"--workdir={run}")
    assert r.returncode == cli.EXIT_OK, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1])["step"] == 6
    r = _main("--mode=eval", f"--config={run}/config.json", "--config.data.eval_split=train",
              "--step=3", f"--workdir={run}")
    assert r.returncode == cli.EXIT_OK, r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert (result["step"], result["split"], result["metrics"]["num_examples"]) == (3, "train", 1442)
    # Without --config, --config.* overrides apply to the run's own config (README: Evaluation).
    r = _main("--mode=eval", f"--workdir={run}", "--config.data.eval_split=train")
    assert r.returncode == cli.EXIT_OK, r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert (result["step"], result["split"], result["metrics"]["num_examples"]) == (6, "train", 1442)


def test_a_config_that_is_not_one_and_a_missing_run_are_one_line_exit_2(tmp_path):
    r = _main("--config=configs/vit_ln.txt", f"--workdir={tmp_path}/wd")
    assert r.returncode == cli.EXIT_CONFIG
    assert _one_line(r, "error:").startswith("error: --config=configs/vit_ln.txt: not a config; "
                                             "accepted: a config file configs/<name>.py")
    r = _main("--mode=eval", f"--workdir={tmp_path}/none")
    assert r.returncode == cli.EXIT_CONFIG
    assert _one_line(r, "error:") == (
        f"error: {tmp_path}/none holds no run to evaluate (no config.json): train one there first, "
        f"e.g. python main.py --config=configs/vit_ln.py:demo --workdir={tmp_path}/none")
    assert os.listdir(tmp_path) == []


def _tool(module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO_ROOT, timeout=300,
                          env=_ENV,
                          capture_output=True, text=True)


def test_post_training_tools_name_what_is_missing_and_refuse_extra_arguments(run, tmp_path):
    none = tmp_path / "none"
    cases = [  # (module, args, what the line must name)
        ("normvit_jax.export", [f"--workdir={none}", f"--out={tmp_path}/m.npz"],
         f"{none} does not exist: train a run there first, e.g. python main.py"),
        ("normvit_jax.reparam", [f"--workdir={run}", "--step=5"],
         "no checkpoint of step 5 in " + f"{run}/checkpoints; there are: [3, 6]"),
        ("normvit_jax.analysis.attention", [f"--workdir={tmp_path}", f"--out={tmp_path}/o"],
         f"{tmp_path} holds no run (no config.json): train one there first"),
        ("normvit_jax.export", [f"--workdir={run}", f"--out={tmp_path}/m.npz", "extra"],
         "unexpected arguments: ['extra']"),
        ("normvit_jax.reparam", [f"--workdir={run}", "extra"], "unrecognized arguments: extra"),
    ]
    for module, args, named in cases:
        r = _tool(module, *args)
        assert r.returncode == 2, (module, args, r.stderr[-2000:])
        line = _one_line(r, f"python -m {module}: error: ")
        assert named in line, (line, named)
    assert not os.path.exists(f"{tmp_path}/m.npz") and not os.path.exists(f"{tmp_path}/o")


def test_an_output_path_that_cannot_be_written_is_one_line_exit_2_before_the_work(run, tmp_path):
    """A file where a folder is needed on the way to --out (--data_dir): one line naming the flag
    and the folder, exit 2, before the tool reads the run (was a traceback after the work)."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    out = f"{blocker}/sub"
    cases = [
        ("normvit_jax.predict", [f"--workdir={run}", f"--images={blocker}", f"--out={out}/p.csv"]),
        ("normvit_jax.reparam", [f"--workdir={run}", f"--out={out}"]),
        ("normvit_jax.export", [f"--workdir={run}", "--format=stablehlo", f"--out={out}/m"]),
        ("normvit_jax.recalibrate", [f"--workdir={run}", f"--out={out}"]),
        ("normvit_jax.analysis.attention", [f"--workdir={run}", f"--out={out}"]),
        ("normvit_jax.analysis.report", [run, f"--out={out}"]),
        ("normvit_jax.data.prepare", [f"--src={tmp_path}", "--name=x", f"--data_dir={out}"]),
    ]
    for module, args in cases:
        r = _tool(module, *args)
        assert r.returncode == 2, (module, r.stderr[-2000:])
        line = _one_line(r, f"python -m {module}: error: " if module != "normvit_jax.data.prepare"
                         else "error: ")
        assert f"{out}" in line and f"cannot write in {blocker} (NotADirectoryError" in line, line
    folder = tmp_path / "a_folder"
    folder.mkdir()
    r = _tool("normvit_jax.export", f"--workdir={run}", "--format=onnx", f"--out={folder}")
    assert r.returncode == 2, r.stderr[-2000:]
    assert sorted(os.listdir(tmp_path)) == ["a_file", "a_folder"]  # nothing written
    assert _one_line(r, "python -m normvit_jax.export: error: ").endswith(
        f"--out={folder} exists and is not a file; pass the path of a file")


# As root, permission bits bind only without CAP_DAC_OVERRIDE/CAP_FOWNER: the child drops them
# from its bounding set, then execs main.py as an ordinary user would run it (as tests/test_faults).
_AS_PLAIN_USER = (
    "import ctypes, os, sys\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "if any(libc.prctl(24, cap, 0, 0, 0) for cap in (1, 2, 3)): sys.exit(77)\n"
    "os.execv(sys.executable, [sys.executable] + sys.argv[1:])\n")


def test_eval_of_a_read_only_workdir_prints_the_metrics_then_says_where_it_could_not_write(
        run, tmp_path):
    import shutil
    import stat
    wd = tmp_path / "ro"
    # Without the results of other tests' evals of `run`: this eval must write none.
    shutil.copytree(run, wd, ignore=shutil.ignore_patterns(".lock", "eval_*.json", "eval_*.png"))
    for p in [wd, *wd.rglob("*")]:
        p.chmod(p.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    prefix = ["-c", _AS_PLAIN_USER] if os.geteuid() == 0 else []
    r = subprocess.run([sys.executable, *prefix, "main.py", "--mode=eval", f"--workdir={wd}"],
                       cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                       env=_ENV)
    if r.returncode == 77:
        pytest.skip("root without CAP_SETPCAP: cannot make a directory unwritable for a child")
    assert r.returncode == cli.EXIT_OK, r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["step"] == 6 and result["path"] is None and result["metrics"]["top1"] > 0
    # the per-class results are printed; no picture is claimed that was not written
    assert sum(result["per_class"]["examples"]) == result["metrics"]["num_examples"]
    assert "picture" not in result["per_class"]
    assert "Traceback" not in r.stderr
    warning = [line for line in r.stderr.splitlines() if "Could not write" in line]
    assert len(warning) == 1 and f"{wd}/eval_digits_test_6.json" in warning[0]
    assert r.stderr.index("eval of step 6 on digits:test") < r.stderr.index("Could not write")
    assert not list(wd.glob("eval_*"))
