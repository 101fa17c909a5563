"""benchmarks.originals' error paths, which need no torch: without torch one line naming the
extra and exit 2; an unknown norm exit 2 before torch is looked for; a missing repository is a
skipped row (that one needs torch: the comparison itself runs only where torch is installed)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(argv: list[str], tmp_path, hide_torch: bool) -> subprocess.CompletedProcess:
    path = [REPO_ROOT]
    if hide_torch:  # a sitecustomize that makes `import torch` fail, as on a machine without it
        shim = tmp_path / "shim"
        shim.mkdir()
        (shim / "sitecustomize.py").write_text("import sys\nsys.modules['torch'] = None\n")
        path.insert(0, str(shim))
    return subprocess.run([sys.executable, "-m", "benchmarks.originals", *argv], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(path)})


def test_without_torch_one_line_naming_the_extra_exit_2(tmp_path):
    r = _run([f"--src={tmp_path}"], tmp_path, hide_torch=True)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("python -m benchmarks.originals: error:") and ".[torch]" in r.stderr
    assert r.stdout == ""


def test_an_unknown_norm_is_one_line_exit_2_before_torch(tmp_path):
    r = _run([f"--src={tmp_path}", "--norms=dtn,bogus"], tmp_path, hide_torch=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "--norms: unknown ['bogus']" in r.stderr and "torch" not in r.stderr


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch (.[torch])")
def test_a_missing_repository_is_a_skipped_row(tmp_path, capsys):
    from benchmarks import originals
    rows = originals.main([f"--src={tmp_path}", "--norms=layernorm,rescale"])
    assert {(r["case"].split(" ")[0], r["skipped"]) for r in rows} == {
        ("layernorm", "DTN/models/normkit/norms/us_layernorm.py not found under --src"),
        ("rescale", "RescaleViT/models/rescale_mapping.py not found under --src")}
    assert "| layernorm | skipped: DTN/" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [
    ["benchmarks.torch_walk_train", "--src={idx}", "--norm=ln", "--out={tmp}/o"],
    ["benchmarks.torch_walk_train", "--src={tmp}/none", "--norm=ln", "--out={tmp}/o"],
    ["benchmarks.torch_walk_compare", "--dir={tmp}/none"]])
def test_the_torch_walk_scripts_refuse_in_one_line(tmp_path, argv):
    """docs/pretrained.md's walk: without torch, or without their inputs, one line and exit 2."""
    idx = tmp_path / "idx"
    idx.mkdir()
    (idx / "train-images-idx3-ubyte.gz").write_bytes(b"")  # found: torch is what is missing
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text("import sys\nsys.modules['torch'] = None\n")
    args = [a.format(idx=idx, tmp=tmp_path) for a in argv]
    r = subprocess.run([sys.executable, "-m", *args], cwd=REPO_ROOT, capture_output=True,
                       text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join([str(shim), REPO_ROOT])})
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr[-2000:]
    assert r.stderr.startswith(f"python -m {args[0]}: error:") and "Traceback" not in r.stderr
    if "{idx}" in argv[1]:
        assert ".[torch]" in r.stderr
