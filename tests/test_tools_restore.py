"""Issue 35, items 2, 3 and 7: every tool that reads a checkpoint restores through one path
(checkpoints.first_restorable), so a damaged newest checkpoint (a truncated data file, a truncated
_METADATA) is one warning naming the step and the file and the previous step is used; every tool
exits with the codes of docs/faults.md's table (no checkpoint: 2; none restores: 4); reparam names
each slot's norm and export says what the .npz leaves out.

One tiny RepBN run (checkpoints at steps 3 and 6; RepBN keeps running statistics and folds) is
shared by the module; each tool runs as the user types it, in a subprocess."""
from __future__ import annotations

import glob
import os
import re
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from normvit_jax import checkpoints, cli, predict, recalibrate, reparam
from normvit_jax.analysis import attention
from normvit_jax.train import loop
from tests.conftest import REPO_ROOT, tiny_demo_config

DAMAGED = r"Checkpoint at step 6 in \S+ is damaged \((.+)\); using step 3 instead\."


def _command(tool: str, wd: str, out: str) -> list[str]:
    """The command of each tool that reads a checkpoint (main.py's eval included)."""
    return {
        "predict": ["-m", "normvit_jax.predict", f"--workdir={wd}", f"--images={out}/img.png"],
        "reparam": ["-m", "normvit_jax.reparam", f"--workdir={wd}", "--batch=2", "--reps=1"],
        "export": ["-m", "normvit_jax.export", f"--workdir={wd}", f"--out={out}/m.npz"],
        "attention": ["-m", "normvit_jax.analysis.attention", f"--workdir={wd}",
                      f"--out={out}/att", "--images=1", "--stat_images=2"],
        "recalibrate": ["-m", "normvit_jax.recalibrate", f"--workdir={wd}", f"--out={out}/rec",
                        "--batches=1"],
        "eval": ["main.py", "--mode=eval", f"--workdir={wd}"],
    }[tool]


def _start(tool: str, wd: str, out) -> subprocess.Popen:
    os.makedirs(out, exist_ok=True)
    Image.fromarray(np.full((8, 8, 3), 128, np.uint8)).save(os.path.join(out, "img.png"))
    env = {**os.environ, "PYTHONPATH": REPO_ROOT, "TF_CPP_MIN_LOG_LEVEL": "2"}
    return subprocess.Popen([sys.executable, *_command(tool, wd, str(out))], cwd=REPO_ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(p: subprocess.Popen) -> subprocess.CompletedProcess:
    try:
        out, err = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def _run(tool: str, wd: str, out) -> subprocess.CompletedProcess:
    return _finish(_start(tool, wd, out))


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> str:
    wd = str(tmp_path_factory.mktemp("repbn") / "run")
    cfg = tiny_demo_config(total_steps=6, checkpoint_every=3, eval_every=6, **{"model.depth": 1})
    cfg.model.norm = {"name": "repbn"}
    loop.train_and_evaluate(cfg, wd)
    assert checkpoints.complete_steps(wd) == [3, 6]
    return wd


def _copy(run: str, dest) -> str:
    shutil.copytree(run, dest, ignore=shutil.ignore_patterns(".lock"))
    return str(dest)


def _truncate_data(step_dir: str) -> None:
    """The largest OCDBT data file cut in half, as a write cut short would leave it."""
    files = [p for p in glob.glob(os.path.join(step_dir, "**", "d", "*"), recursive=True)
             if os.path.isfile(p)]
    victim = max(files, key=os.path.getsize)
    with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) // 2)


def _truncate_metadata(step_dir: str) -> str:
    path = os.path.join(step_dir, "state", "_METADATA")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    return path


DAMAGED_TOOLS = ("predict", "reparam", "export", "attention", "recalibrate")


@pytest.fixture(scope="module")
def on_damaged(run, tmp_path_factory):
    """tool -> (workdir, out folder, the command's result): the tool run once on its own copy of
    the run whose newest checkpoint has a truncated data file (predict's serves two tests). The
    five processes start together on the first request (each reads only its own copy), so
    their start-ups overlap."""
    started, done = {}, {}

    def get(tool: str):
        if not started:
            for t in DAMAGED_TOOLS:
                root = tmp_path_factory.mktemp(f"damaged_{t}")
                wd = _copy(run, root / "wd")
                _truncate_data(os.path.join(wd, "checkpoints", "6"))
                started[t] = wd, root / "out", _start(t, wd, root / "out")
        if tool not in done:
            wd, out, p = started[tool]
            done[tool] = wd, out, _finish(p)
        return done[tool]
    yield get
    for _, _, p in started.values():
        if p.poll() is None:
            p.kill()
            p.communicate()


@pytest.mark.parametrize("tool", DAMAGED_TOOLS)
def test_each_tool_skips_a_damaged_newest_checkpoint_with_one_warning(on_damaged, tool):
    wd, out_dir, r = on_damaged(tool)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "Traceback" not in out
    hits = [line for line in out.splitlines() if re.search(DAMAGED, line)]
    assert len(hits) == 1, out[-3000:]
    assert f"{wd}/checkpoints/6/state" in hits[0]  # the file that failed, under the step
    assert checkpoints.complete_steps(wd) == [3, 6]  # read-only: nothing moved
    if tool == "export":  # item 7: what the .npz leaves out and which format keeps it
        note = [line for line in out.splitlines() if "running-statistics arrays" in line]
        assert len(note) == 1 and "normvit_jax.reparam" in note[0] and "left out" in note[0]
        exported = np.load(out_dir / "m.npz")
        step3, _ = checkpoints.load_params(wd, 3)
        np.testing.assert_array_equal(exported["head/kernel"], step3["head"]["kernel"])
    if tool == "reparam":  # item 7: the slots by the norm they hold
        assert "folded repbn (before attention) at Transformer/encoderblock_0/LayerNorm_0" in out
        assert "folded repbn (final norm) at Transformer/encoder_norm" in out


def test_a_truncated_metadata_file_is_named_and_skipped(run, tmp_path, caplog):
    wd = _copy(run, tmp_path / "wd")
    path = _truncate_metadata(os.path.join(wd, "checkpoints", "6"))
    restored, _ = checkpoints.restore_numpy(wd)
    assert restored.step == 3 and restored.damaged[0][0] == 6
    assert path in restored.damaged[0][1] and "JSONDecodeError" in restored.damaged[0][1]
    # The command of the report (exit 2 before), through its main in this process: the same
    # restore path as the process of test_each_tool_skips_...[predict], which exits 0 on it.
    os.makedirs(tmp_path / "out")
    Image.fromarray(np.full((8, 8, 3), 128, np.uint8)).save(tmp_path / "out" / "img.png")
    caplog.clear()
    with caplog.at_level("WARNING"):
        rows, skipped = predict.main([f"--workdir={wd}", f"--images={tmp_path}/out/img.png"])
    assert len(rows) == 1 and not skipped
    hits = [r.getMessage() for r in caplog.records if re.search(DAMAGED, r.getMessage())]
    assert len(hits) == 1 and path in hits[0], caplog.text[-3000:]
    with pytest.raises(checkpoints.CheckpointMismatchError, match=r"step 6: .*_METADATA"):
        checkpoints.restore_numpy(wd, 6)  # the step asked for: no fallback, exit 4


def test_a_deleted_metadata_file_is_named_in_one_warning(run, tmp_path):
    """Training and --mode=eval named a healthy OCDBT data file (state/d/<hash>, which is not
    JSON) as the file that failed, beside Orbax's warning about a CheckpointHandlerRegistry."""
    wd = _copy(run, tmp_path / "wd")
    path = os.path.join(wd, "checkpoints", "6", "state", "_METADATA")
    os.remove(path)
    r = _run("eval", wd, tmp_path / "out")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    hits = [line for line in r.stderr.splitlines() if re.search(DAMAGED, line)]
    assert len(hits) == 1 and f"Metadata file {path} does not exist" in hits[0], r.stderr[-3000:]
    assert "/d/" not in hits[0] and "CheckpointHandlerRegistry" not in r.stderr


@pytest.mark.parametrize("tool", ["predict", "reparam", "export", "attention", "recalibrate",
                                  "eval"])
def test_no_checkpoint_exits_2_in_one_line_from_every_tool(run, tmp_path, tool):
    """docs/faults.md: a workdir with config.json but no checkpoint is the same code everywhere."""
    wd = tmp_path / "wd"
    wd.mkdir()
    shutil.copy(os.path.join(run, "config.json"), wd / "config.json")
    r = _run(tool, str(wd), tmp_path / "out")
    assert r.returncode == cli.EXIT_CONFIG, (tool, r.stderr[-3000:])
    assert "Traceback" not in r.stderr
    lines = [line for line in r.stderr.splitlines() if "no checkpoint in" in line]
    assert len(lines) == 1 and "the run has not saved one yet" in lines[0], r.stderr[-3000:]


def test_no_checkpoint_that_restores_exits_4_from_every_tool(run, tmp_path, capsys):
    wd = _copy(run, tmp_path / "wd")
    for step in (3, 6):
        _truncate_data(os.path.join(wd, "checkpoints", str(step)))
    calls = {  # the tools' own main functions, in this process (the subprocess path is above)
        "predict": lambda: predict.main([f"--workdir={wd}", f"--images={tmp_path}"]),
        "reparam": lambda: reparam.main([f"--workdir={wd}"]),
        "attention": lambda: attention.main([f"--workdir={wd}", f"--out={tmp_path}/a"]),
        "recalibrate": lambda: recalibrate.main([f"--workdir={wd}", f"--out={tmp_path}/r"]),
    }
    for tool, call in calls.items():
        with pytest.raises(SystemExit) as e:
            call()
        assert e.value.code == cli.EXIT_CHECKPOINT, tool
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and re.search(r"error: no checkpoint in \S+ restores: step 6: .*; "
                                           r"step 3: .*Nothing was moved or deleted\.$", err[0]), err
    assert checkpoints.complete_steps(wd) == [3, 6]


def test_main_py_with_an_extra_argument_is_one_line_exit_2():
    r = subprocess.run([sys.executable, "main.py", "--config=configs/vit_ln.py:demo",
                        "--workdir=runs/x", "extra"], cwd=REPO_ROOT, capture_output=True,
                       text=True, timeout=120, env={**os.environ, "PYTHONPATH": REPO_ROOT})
    assert r.returncode == cli.EXIT_CONFIG, r.stderr[-2000:]
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert lines == ["error: unexpected arguments ['extra']: main.py takes only flags "
                     "(--config=..., --workdir=..., --config.KEY=VALUE; --help lists them)"]
    assert not os.path.exists(os.path.join(REPO_ROOT, "runs", "x"))


def test_one_exit_code_table_in_the_docs_and_the_readme():
    """docs/faults.md's table is the README's, and its codes are cli's."""
    def table(path: str) -> str:
        with open(os.path.join(REPO_ROOT, path)) as f:
            return f.read().split("<!-- exit-codes:begin -->")[1].split("<!-- exit-codes:end -->")[0]
    doc = table("docs/faults.md")
    assert doc == table("README.md")
    codes = [int(line.split("|")[1]) for line in doc.strip().splitlines()[2:]]
    assert codes == sorted({0, 1, cli.EXIT_CONFIG, cli.EXIT_NONFINITE, cli.EXIT_CHECKPOINT,
                            cli.EXIT_WORKDIR, cli.EXIT_BUSY, cli.EXIT_DISTRIBUTED,
                            cli.EXIT_PREEMPTED, cli.EXIT_INTERRUPTED,
                            128 + signal.SIGTERM})  # preemption.py: a second SIGTERM, os._exit


def test_the_deploy_bundle_reads_through_the_same_path(run, tmp_path):
    """export --format=onnx|savedmodel|stablehlo reads the run by deploy.bundle.load: a damaged
    newest step is skipped as by the other tools and the bundle names the step it used."""
    from normvit_jax.deploy import bundle
    wd = _copy(run, tmp_path / "wd")
    _truncate_data(os.path.join(wd, "checkpoints", "6"))
    b = bundle.load(wd, log=None)
    assert b.source["step"] == 3
    step3, _ = checkpoints.load_params(wd, 3)
    np.testing.assert_array_equal(b.variables["params"]["head"]["kernel"], step3["head"]["kernel"])
    with pytest.raises(checkpoints.CheckpointMismatchError, match="step 6"):
        bundle.load(wd, step=6, log=None)


def _export(wd: str, out) -> subprocess.CompletedProcess:
    fmt = "stablehlo" if str(out).endswith(".stablehlo") else "onnx"
    return subprocess.run([sys.executable, "-m", "normvit_jax.export", f"--workdir={wd}",
                           f"--format={fmt}", f"--out={out}"], cwd=REPO_ROOT,
                          env={**os.environ, "PYTHONPATH": REPO_ROOT, "TF_CPP_MIN_LOG_LEVEL": "2"},
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def onnx_folder(run, tmp_path_factory) -> str:
    """A folder holding one ONNX export of the run (a.onnx, a.onnx.json, classes.json), exported
    once for the module by the command in a subprocess; each test copies it."""
    folder = tmp_path_factory.mktemp("onnx") / "artifacts"
    r = _export(run, folder / "a.onnx")
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(os.listdir(folder)) == ["a.onnx", "a.onnx.json", "classes.json"]
    return str(folder)


@pytest.mark.parametrize("damage", ["truncated", "not a list", "not utf-8"])
def test_export_names_a_damaged_classes_json_shared_with_other_artifacts(run, onnx_folder, tmp_path,
                                                                        capsys, damage):
    """ONNX/StableHLO files of one folder share its classes.json; a damaged one was refused as
    "the class names of a.onnx, not this model's" (a model with other classes, which there was
    not), and JSON that is not a list was a traceback. Now: one line naming the file as damaged
    and what to do, exit 2, nothing written. The command runs in a subprocess for one damage and
    format (the real exit status and stderr), export's main in this process for the others."""
    from tests.test_export_formats import _export_main
    folder = tmp_path / "artifacts"
    shutil.copytree(onnx_folder, folder)
    classes = folder / "classes.json"
    classes.write_bytes({"truncated": b'["0", "1', "not a list": b"5",
                         "not utf-8": b"\xff\xfe[]"}[damage])
    for out in (folder / "b.onnx", folder / "b.stablehlo"):
        if damage == "truncated" and out.suffix == ".onnx":
            r = _export(run, out)
            code, err = r.returncode, r.stderr
        else:
            fmt = "stablehlo" if out.suffix == ".stablehlo" else "onnx"
            code, _, err = _export_main([f"--workdir={run}", f"--format={fmt}", f"--out={out}"],
                                        capsys)
        lines = err.strip().splitlines()
        assert code == cli.EXIT_CONFIG and len(lines) == 1, err[-3000:]
        assert lines[0].startswith(f"python -m normvit_jax.export: error: {classes} is not ")
        assert "it names the classes of a.onnx in this folder: restore it, or export to another "\
               "folder" in lines[0] and "not this model's" not in lines[0]
        assert not out.exists() and not (folder / (out.name + ".json")).exists()
    assert sorted(os.listdir(folder)) == ["a.onnx", "a.onnx.json", "classes.json"]



def test_a_json_file_that_cannot_be_read_is_named_with_what_to_do(tmp_path):
    """run_config.read_json, the reader of every JSON file the project writes: one that cannot be
    read (permissions for a user who is not root; a folder of that name here, which root cannot
    bypass) was a bare OSError, a traceback with exit 1 from every tool; now the caller's error
    (exit 2 through cli.tool_errors) naming it; a missing file stays FileNotFoundError."""
    from normvit_jax import run_config
    from normvit_jax.deploy.errors import DeployError
    folder = tmp_path / "classes.json"
    folder.mkdir()
    with pytest.raises(DeployError) as e:
        run_config.read_json(folder, "export the artifact again", DeployError)
    assert str(e.value) == (f"{folder} cannot be read (IsADirectoryError: Is a directory); make "
                            f"it readable, or export the artifact again")
    assert cli.exit_code(e.value) == cli.EXIT_CONFIG
    with pytest.raises(FileNotFoundError):
        run_config.read_json(tmp_path / "absent.json", "unused")


@pytest.mark.parametrize("damage", ["manifest", "state", "empty"])
def test_a_missing_part_of_a_checkpoint_is_named(run, tmp_path, damage):
    """A deleted state/manifest.ocdbt, state/ folder or an emptied step folder was named by
    Orbax's echo ('Metadata at "nonfinite_streak/.zarray" ... does not exist', "KeyError: 'Unknown
    key: state. Available keys: dict_keys(['meta'])'"), not by what is missing."""
    wd = _copy(run, tmp_path / "wd")
    step6 = os.path.join(wd, "checkpoints", "6")
    if damage == "manifest":
        os.remove(os.path.join(step6, "state", "manifest.ocdbt"))
        said = "6/state/manifest.ocdbt is missing"
    elif damage == "state":
        shutil.rmtree(os.path.join(step6, "state"))
        said = "6/state/ is missing"
    else:
        shutil.rmtree(step6)
        os.mkdir(step6)
        said = "6/ is empty"
    restored, _ = checkpoints.restore_numpy(wd)
    assert restored.step == 3 and restored.damaged[0][0] == 6
    assert said in restored.damaged[0][1], restored.damaged[0][1]
    assert "KeyError" not in restored.damaged[0][1] and ".zarray" not in restored.damaged[0][1]


def test_predict_logs_in_the_format_of_the_other_tools(on_damaged):
    """predict (argparse, no absl.app) printed 'WARNING:normvit_jax.checkpoints:Checkpoint ...',
    Python's default format, where export and main.py print absl's 'W1129 05:06:39.123 ...'."""
    _, _, r = on_damaged("predict")
    assert r.returncode == 0, r.stderr[-3000:]
    hits = [line for line in r.stderr.splitlines() if re.search(DAMAGED, line)]
    assert len(hits) == 1 and re.match(r"W\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ checkpoints\.py:\d+\] "
                                       r"Checkpoint at step 6", hits[0]), hits
