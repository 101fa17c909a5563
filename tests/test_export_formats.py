"""Issue 34: a trained run exported as ONNX, TF SavedModel and StableHLO (normvit_jax.deploy),
checked in the runtimes a user deploys on, in a process that never imports normvit_jax
(tests/artifact_runner.py: onnxruntime, tf.saved_model.load, jax.export.deserialize), against
``python -m normvit_jax.predict`` on the same workdir: probabilities within 1e-5, the same top-1
on every image; folded artifacts likewise, and without the norms' operations in their graphs.

The runs are the methods' ``:demo`` configs shrunk to one 32-wide block and trained 4 steps
(tests/deploy_runs.py: weights, running statistics and norm affines moved off their initial
values)."""
from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from normvit_jax import predict
from normvit_jax.data import digits
from normvit_jax.deploy import artifact, bundle, errors, onnx_format, stablehlo_format
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.usefixtures("float32_matmuls")
METHODS = {"ln": "vit_ln", "un": "vit_un", "repbn": "vit_repbn", "progressive": "vit_progressive",
           "dyt": "vit_dyt", "dtn": "vit_dtn"}
FOLDS_ENTIRELY = ("un", "repbn", "progressive")  # every slot becomes the identity
FOLDS = FOLDS_ENTIRELY + ("dyt",)                 # DyT: its scale/bias fold, tanh stays
FORMATS = {"onnx": ".onnx", "savedmodel": ".savedmodel", "stablehlo": ".stablehlo"}
TOL = 1e-5


def train_runs(root: str, methods: list[str]) -> dict[str, str]:
    """The methods' shrunk :demo runs (tests/deploy_runs.py), trained in one child process."""
    env = {**os.environ, "PYTHONPATH": REPO_ROOT, "TF_CPP_MIN_LOG_LEVEL": "2",
           "XLA_FLAGS": "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"}
    r = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "tests", "deploy_runs.py"), root,
                        *methods], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return {m: os.path.join(root, m) for m in methods}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, str]:
    trained = train_runs(str(tmp_path_factory.mktemp("runs")), list(METHODS.values()))
    return {norm: trained[m] for norm, m in METHODS.items()}


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> list[str]:
    """Twelve real digits of the test split, as the 8x8 PNG files a user would send."""
    from PIL import Image
    root = tmp_path_factory.mktemp("images")
    x, _ = digits.load("test")
    paths = []
    for i in range(0, 12 * 29, 29):
        paths.append(str(root / f"digit_{i:03d}.png"))
        Image.fromarray(np.rint(x[i] * 255).astype(np.uint8)).save(paths[-1])
    return paths


@pytest.fixture(scope="module")
def reference(runs, images) -> dict[str, np.ndarray]:
    """Each run's probabilities from the predict command (all classes, in class order)."""
    out = {}
    for norm, wd in runs.items():
        rows, skipped = predict.main([f"--workdir={wd}", "--images=" + ",".join(images),
                                      "--top_k=10", "--batch=16"])
        assert not skipped and [r["path"] for r in rows] == images
        names = json.load(open(os.path.join(wd, "classes.json")))
        out[norm] = np.array([[dict(r["top"])[n] for n in names] for r in rows])
    return out


@pytest.fixture(scope="module")
def artifacts(runs, tmp_path_factory) -> dict[str, dict[str, str]]:
    """{format: {'ln': path, 'repbn_folded': path, ...}}: every run, and folded where it folds."""
    root = tmp_path_factory.mktemp("artifacts")
    out: dict[str, dict[str, str]] = {fmt: {} for fmt in FORMATS}
    for norm, wd in runs.items():
        for fold in (False, True) if norm in FOLDS else (False,):
            b = bundle.load(wd, fold=fold, log=None)
            key = norm + ("_folded" if fold else "")
            for fmt, ext in FORMATS.items():
                out[fmt][key] = str(root / fmt / (key + ext))
                artifact.export_artifact(b, fmt, out[fmt][key], log=None)
    return out


@pytest.fixture(scope="module")
def outputs(artifacts, images, tmp_path_factory) -> dict[str, dict]:
    """Each format's artifacts run by its own runtime, one process per runtime, side by side."""
    root = tmp_path_factory.mktemp("outputs")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(TF_CPP_MIN_LOG_LEVEL="2", JAX_PLATFORMS="cpu")
    procs = {}
    for fmt in FORMATS:
        jobs = root / f"{fmt}.json"
        jobs.write_text(json.dumps({"runtime": fmt, "images": images, "artifacts": artifacts[fmt],
                                    "out": str(root / f"{fmt}.npz")}))
        procs[fmt] = subprocess.Popen(
            [sys.executable, os.path.join(REPO_ROOT, "tests", "artifact_runner.py"), str(jobs)],
            cwd=str(root), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = {}
    for fmt, p in procs.items():
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        out[fmt] = dict(np.load(root / f"{fmt}.npz"))
    return out


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_artifacts_agree_with_predict_in_their_own_runtime(fmt, outputs, reference, runs):
    got = outputs[fmt]
    for norm in METHODS:
        want = reference[norm]
        assert want.std(0).max() > 10 * TOL, f"{norm}: predictions that hardly depend on the image"
        for key in (norm, norm + "_folded") if norm in FOLDS else (norm,):
            probs, logits = got[f"{key}/probabilities"], got[f"{key}/logits"]
            assert probs.dtype == np.float32 and probs.shape == want.shape, key
            assert np.abs(probs - want).max() <= TOL, (fmt, key, np.abs(probs - want).max())
            np.testing.assert_array_equal(probs.argmax(1), want.argmax(1), err_msg=key)
            e = np.exp(logits - logits.max(1, keepdims=True))  # the logits they came from
            np.testing.assert_allclose(probs, e / e.sum(1, keepdims=True), atol=1e-6)
            names = json.load(open(os.path.join(runs[norm], "classes.json")))
            assert list(got[f"{key}/classes"]) == names


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_folded_artifacts_agree_with_unfolded(fmt, outputs):
    for norm in FOLDS:
        a, b = outputs[fmt][f"{norm}/probabilities"], outputs[fmt][f"{norm}_folded/probabilities"]
        assert np.abs(a - b).max() <= TOL, (norm, np.abs(a - b).max())
        np.testing.assert_array_equal(a.argmax(1), b.argmax(1))


NORM_OPS_ONNX = re.compile(r"^(Sqrt|Reciprocal|Pow|Sub|Reduce\w*|\w*Normalization)$")


def _onnx_norm_ops(path: str) -> int:
    import onnx
    return sum(bool(NORM_OPS_ONNX.match(n.op_type)) for n in onnx.load(path).graph.node)


def _stablehlo_ops(path: str) -> collections.Counter:
    with open(path, "rb") as f:
        text = jax.export.deserialize(bytearray(f.read())).mlir_module()
    return collections.Counter(re.findall(r"stablehlo\.(\w+)", text))


def test_folded_graphs_have_no_normalization_left(artifacts):
    """ONNX: no square root, subtraction, reduction or normalization op; StableHLO: no (r)sqrt,
    and the only reductions and subtractions are the softmaxes' (max, sum; x - max). Unfolded,
    each of the 3 norm slots (2 in the block, the final norm) has its rsqrt."""
    for norm in FOLDS_ENTIRELY:
        assert _onnx_norm_ops(artifacts["onnx"][norm]) >= 3
        assert _onnx_norm_ops(artifacts["onnx"][norm + "_folded"]) == 0, norm
        assert _stablehlo_ops(artifacts["stablehlo"][norm])["rsqrt"] >= 3
        ops = _stablehlo_ops(artifacts["stablehlo"][norm + "_folded"])
        assert ops["rsqrt"] == ops["sqrt"] == 0, (norm, ops)
        assert ops["reduce"] == 2 * ops["exponential"] and ops["subtract"] == ops["exponential"]
    ops = _stablehlo_ops(artifacts["stablehlo"]["dyt_folded"])  # tanh(alpha x) stays per slot
    assert ops["tanh"] - _stablehlo_ops(artifacts["stablehlo"]["ln"])["tanh"] == 3


def test_metadata_travels_with_the_artifact(artifacts, runs):
    meta, names = artifact.read_metadata(artifacts["onnx"]["repbn_folded"])
    assert names == json.load(open(os.path.join(runs["repbn"], "classes.json")))
    assert meta["input"] == {"name": "image", "dtype": "uint8", "shape": [None, 8, 8, 3],
                             "layout": meta["input"]["layout"]}
    assert meta["preprocess"]["image_size"] == 8 and meta["source"]["step"] == 4
    assert len(meta["source"]["folded"]) == 3 and meta["normalize_in_graph"]["scale"] == [1.0] * 3
    import onnx
    props = {p.key: p.value for p in onnx.load(artifacts["onnx"]["ln"]).metadata_props}
    assert json.loads(props["classes"]) == names and json.loads(props["normvit_jax.deploy"])
    sm = artifacts["savedmodel"]["ln"]
    assert json.load(open(os.path.join(sm, "assets", "classes.json"))) == names
    assert artifact.read_metadata(sm)[0]["format"] == "savedmodel"


def _export(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "normvit_jax.export", *args], cwd=REPO_ROOT,
                          env={**os.environ, "PYTHONPATH": REPO_ROOT, "TF_CPP_MIN_LOG_LEVEL": "2"},
                          capture_output=True, text=True, timeout=300)


def test_export_command_writes_a_fixed_batch_folded_onnx(runs, tmp_path):
    out = tmp_path / "m.onnx"
    r = _export(f"--workdir={runs['un']}", "--format=onnx", f"--out={out}", "--fold", "--batch=3")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "folded 3 norm slot(s)" in r.stdout and "exported the onnx artifact" in r.stdout
    import onnxruntime as ort
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    assert session.get_inputs()[0].shape == [3, 8, 8, 3]
    assert json.load(open(str(out) + ".json"))["input"]["shape"][0] == 3
    assert (tmp_path / "classes.json").exists()


@pytest.mark.parametrize("args, message", [
    (["--format=onnx", "--batch=0"], "--batch=0: must be >= 1"),
    (["--format=npz", "--fold"], "--fold, --batch and --folded apply to"),
    (["--format=stablehlo", "--folded=/nonexistent"], "model.json not found"),
])
def test_export_command_refuses_bad_input_in_one_line(runs, tmp_path, args, message):
    r = _export(f"--workdir={runs['ln']}", f"--out={tmp_path / 'x'}", *args)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    lines = [line for line in r.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1 and message in lines[0], r.stderr[-2000:]


def test_an_operation_a_format_cannot_express_is_named():
    """A host callback has no ONNX operator and cannot be serialized by jax.export (nor so by
    jax2tf): the error names the operation and the format (the command prints it, exit 2)."""
    def fn(x):
        return jax.pure_callback(np.asarray, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
    spec = jax.ShapeDtypeStruct((2, 3), jnp.float32)
    with pytest.raises(errors.UnsupportedOpError, match=r"--format=onnx cannot express the "
                                                        r"operation 'pure_callback'"):
        onnx_format.to_onnx(fn, [spec])
    with pytest.raises(errors.UnsupportedOpError, match=r"--format=stablehlo cannot express the "
                                                        r"operation '[^']*callback"):
        stablehlo_format.export(fn, spec)
    with pytest.raises(errors.MissingExtraError, match=r"pip install -e '\.\[deploy\]'"):
        errors.require("no_such_module_for_the_test", "the onnx format")


def test_derf_savedmodel_runs_in_tensorflow_or_names_the_operation(tmp_path):
    """JAX 0.10 writes erf as a StableHLO ``composite`` that TF 2.21's XlaCallModule cannot read:
    the export runs the signature once in TF and turns that into the one-line error (exit 2 in
    the command), naming the operation and the format, instead of an artifact that fails later.
    A TF that reads it gives a SavedModel that runs."""
    from tests.deploy_runs import demo_config
    from normvit_jax import models
    c = demo_config("vit_derf")
    v = models.create(c.model, 10).init(jax.random.key(0), np.zeros((1, 8, 8, 3)), train=False)
    b = bundle.from_variables(c, c.model, v, 10, log=None)
    try:
        artifact.export_artifact(b, "savedmodel", str(tmp_path / "derf"), log=None)
    except errors.UnsupportedOpError as e:
        assert re.search(r"^--format=savedmodel cannot express the operation '[\w.]+' .*"
                         r"pointwise\.py:\d+.*XlaCallModule cannot read it", str(e)), str(e)
        assert "\n" not in str(e) and not (tmp_path / "derf").exists()
    else:
        from normvit_jax.deploy import runtimes
        probs, _ = runtimes.open_artifact(str(tmp_path / "derf"), "savedmodel")(
            np.zeros((2, 8, 8, 3), np.uint8))
        np.testing.assert_allclose(probs.sum(1), 1.0, atol=1e-5)
