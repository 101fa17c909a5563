"""Issue 34: a trained run exported as ONNX, TF SavedModel and StableHLO (normvit_jax.deploy),
checked in the runtimes a user deploys on, in a process that never imports normvit_jax
(tests/artifact_runner.py: onnxruntime, tf.saved_model.load, jax.export.deserialize), against
``python -m normvit_jax.predict`` on the same workdir: probabilities within 1e-5, the same top-1
on every image; folded artifacts likewise, and without the norms' operations in their graphs.

One child process (tests/deploy_runs.py) trains the methods' ``:demo`` configs shrunk to one
32-wide block for 4 steps (weights, running statistics and norm affines moved off their initial
values), runs predict on twelve real digits and writes every artifact; one child per runtime
then runs them. Both with XLA's backend optimizations off (deploy_runs.XLA_FAST): the compiles
are most of these tests' time."""
from __future__ import annotations

import collections
import contextlib
import functools
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from normvit_jax import export
from normvit_jax.deploy import artifact, errors, onnx_format, stablehlo_format
from tests.conftest import REPO_ROOT
from tests.deploy_runs import FOLDS_ENTIRELY, FORMATS, METHODS, XLA_FAST, folded_in, keys

pytestmark = pytest.mark.usefixtures("float32_matmuls")
TOL = 1e-5


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict:
    """tests/deploy_runs.py's manifest: runs, images, artifacts, the reference probabilities."""
    root = str(tmp_path_factory.mktemp("deploy"))
    env = {**os.environ, "PYTHONPATH": REPO_ROOT, "TF_CPP_MIN_LOG_LEVEL": "2",
           "XLA_FLAGS": XLA_FAST}
    r = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "tests", "deploy_runs.py"), root],
                       env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    with open(os.path.join(root, "manifest.json"), encoding="utf-8") as f:
        manifest = json.load(f)
    manifest["reference"] = dict(np.load(os.path.join(root, "reference.npz")))
    return manifest


@pytest.fixture(scope="module")
def runs(built) -> dict[str, str]:
    return built["runs"]


@pytest.fixture(scope="module")
def reference(built) -> dict[str, np.ndarray]:
    return built["reference"]


@pytest.fixture(scope="module")
def artifacts(built) -> dict[str, dict[str, str]]:
    """{format: {'ln': path, 'repbn_folded': path, ...}}: every run, and folded where it folds."""
    return built["artifacts"]


@pytest.fixture(scope="module")
def outputs(built, tmp_path_factory) -> dict[str, dict]:
    """{format: {'<key>/probabilities': ...}}: every artifact run by its own runtime, in one
    process that never imports normvit_jax (tests/artifact_runner.py)."""
    root = tmp_path_factory.mktemp("outputs")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(TF_CPP_MIN_LOG_LEVEL="2", JAX_PLATFORMS="cpu", XLA_FLAGS=XLA_FAST)
    jobs = root / "jobs.json"
    jobs.write_text(json.dumps({"images": built["images"], "artifacts": built["artifacts"],
                                "out": str(root / "out.npz")}))
    r = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "tests", "artifact_runner.py"),
                        str(jobs)], cwd=str(root), env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out: dict[str, dict] = {fmt: {} for fmt in FORMATS}
    for name, value in np.load(root / "out.npz").items():
        fmt, key = name.split("/", 1)
        out[fmt][key] = value
    return out


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_artifacts_agree_with_predict_in_their_own_runtime(fmt, outputs, reference, runs):
    got = outputs[fmt]
    assert len(got) == 3 * len(keys(fmt)) >= 3 * len(METHODS)
    for norm in METHODS:
        want = reference[norm]
        assert want.std(0).max() > 10 * TOL, f"{norm}: predictions that hardly depend on the image"
        for key in (k for k in keys(fmt) if k.split("_folded")[0] == norm):
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
    """Every folding norm in ONNX and StableHLO; RepBN in the SavedModel (deploy_runs.keys)."""
    for norm in folded_in(fmt):
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


def _export_main(args: list[str], capsys) -> tuple[int, str, str]:
    """The command's ``main`` in this process: (exit status, stdout, stderr)."""
    from absl import flags
    export.define_flags()
    flags.FLAGS.unparse_flags()
    flags.FLAGS(["export", *args])
    code = 0
    try:
        export.main(["export"])
    except SystemExit as e:
        code = e.code
    finally:
        flags.FLAGS.unparse_flags()
    out = capsys.readouterr()
    return code, out.out, out.err


def test_export_command_writes_a_fixed_batch_folded_onnx(runs, tmp_path, capsys):
    out = tmp_path / "m.onnx"
    code, stdout, err = _export_main([f"--workdir={runs['un']}", "--format=onnx", f"--out={out}",
                                      "--fold", "--batch=3"], capsys)
    assert code == 0, err[-3000:]
    assert "folded 3 norm slot(s)" in stdout and "exported the onnx artifact" in stdout
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
def test_export_command_refuses_bad_input_in_one_line(runs, tmp_path, capsys, args, message):
    code, _, err = _export_main([f"--workdir={runs['ln']}", f"--out={tmp_path / 'x'}", *args],
                                capsys)
    assert code == 2 and "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and message in lines[0], err[-2000:]
    assert not os.path.exists(tmp_path / "x")


def test_step_with_folded_is_refused_not_ignored(tmp_path, capsys):
    """--folded exports the folder reparam wrote, whatever --step says: the step was silently
    not used (a user got another step's model than asked). Refused before anything is read."""
    code, _, err = _export_main([f"--workdir={tmp_path / 'run'}", f"--out={tmp_path / 'm.onnx'}",
                                 "--format=onnx", f"--folded={tmp_path / 'folded'}", "--step=4"],
                                capsys)
    assert code == 2 and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == (
        f"python -m normvit_jax.export: error: --step=4 picks a checkpoint, but "
        f"--folded={tmp_path / 'folded'} exports the model that folder holds; fold that step "
        f"first: python -m normvit_jax.reparam --workdir={tmp_path / 'run'} --step=4 --out=DIR, "
        f"then --folded=DIR without --step")
    assert sorted(os.listdir(tmp_path)) == []


def test_the_export_command_exits_2_in_one_line(runs, tmp_path):
    """The command as a user runs it (the tests above call its main in this process)."""
    r = subprocess.run([sys.executable, "-m", "normvit_jax.export", f"--workdir={runs['un']}",
                        "--format=onnx", f"--out={tmp_path / 'm.onnx'}", "--batch=0"],
                       cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": REPO_ROOT},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.strip().splitlines()[-1] == ("python -m normvit_jax.export: error: --batch=0: "
                                                 "must be >= 1 (leave it out for any batch)")


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


def test_derf_savedmodel_runs_in_tensorflow_or_names_the_operation(built):
    """JAX 0.10 writes erf as a StableHLO ``composite`` that TF 2.21's XlaCallModule cannot read:
    the export runs the signature once in TF and turns that into the one-line error (exit 2 in
    the command), naming the operation and the format, instead of an artifact that fails later.
    A TF that reads it gives a SavedModel that runs (tests/deploy_runs.py tried both)."""
    derf = built["derf"]
    if "error" in derf:
        assert re.search(r"^--format=savedmodel cannot express the operation '[\w.]+' .*"
                         r"pointwise\.py:\d+.*XlaCallModule cannot read it", derf["error"]), derf
        assert "\n" not in derf["error"] and not derf["written"]
    else:
        np.testing.assert_allclose(derf["sums"], 1.0, atol=1e-5)


def test_a_savedmodel_has_a_dynamic_batch_or_the_error_says_how_to_export_one(built, artifacts):
    """JAX 0.11 checks a dynamic batch's size with a custom call that TF 2.21 cannot read: the
    export stops with one line naming the cause and --batch=N (exit 2 in the command; the
    fixed-batch SavedModels then written run above). With JAX 0.10 the batch is dynamic."""
    errors_seen = built["dynamic_batch_errors"]
    for key in keys("savedmodel"):
        meta = artifact.read_metadata(artifacts["savedmodel"][key])[0]
        if key + ".savedmodel" in errors_seen:
            text = errors_seen[key + ".savedmodel"]
            assert "\n" not in text and re.match(
                r"--format=savedmodel with a dynamic batch: TensorFlow [\d.]+'s XlaCallModule "
                r"cannot read the batch-size check .* jax 0\.1[1-9][\d.]* writes .*--batch=N",
                text), text
            assert meta["input"]["shape"][0] == 12
        else:
            assert meta["input"]["shape"][0] is None
    if jax.__version_info__ < (0, 11):
        assert not errors_seen, errors_seen


@pytest.mark.parametrize("impl", ["fused", "fused_sdpa", "separate"])
def test_matmul_attention_is_the_attention_of_every_impl(impl):
    """``layers.matmul_attention()`` (what the ONNX export traces: transposes and batched
    matmuls, no einsum) computes the same function of the same parameters as each attention
    impl; and ``attention_matmul`` is softmax(q k^T / sqrt(Dh)) v against numpy (float64)."""
    from normvit_jax import models
    from normvit_jax.models import layers
    x = jax.random.normal(jax.random.key(0), (3, 8, 8, 3))
    model = models.create({"variant": "Ti/4", "depth": 1, "hidden_size": 16, "num_heads": 2,
                           "attention_impl": impl}, num_classes=4)
    rng = np.random.default_rng(1)  # random weights at init's shapes (nothing compiled)
    v = jax.tree.map(lambda a: rng.normal(0, 0.3, a.shape).astype(np.float32),
                     jax.eval_shape(model.init, jax.random.key(1), x))
    def batch_dims(matmul: bool) -> set[str]:
        """The batch dimensions of the program's batched products (a fresh trace)."""
        with layers.matmul_attention() if matmul else contextlib.nullcontext():
            text = str(jax.make_jaxpr(lambda v: model.apply(v, x))(v))
        return set(re.findall(r"dimension_numbers=\(\(\[\d+\], \[\d+\]\), (\(\[[\d, ]+\], "
                              r"\[[\d, ]+\]\))\)", text))
    # matmul_attention: only leading batch dimensions, what ONNX MatMul takes (einsum: (0, 2))
    assert batch_dims(True) == {"([0, 1], [0, 1])"} != batch_dims(False)
    want = jax.jit(lambda v: model.apply(v, x))(v)
    with layers.matmul_attention():  # the switch is read while tracing
        got = jax.jit(lambda v: model.apply(v, x))(v)
    assert float(jnp.abs(want).max()) > 0.1
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

    q, k, w = (np.random.default_rng(i).normal(0, 1, (2, 5, 3, 4)) for i in range(3))
    logits = np.einsum("bqhd,bkhd->bhqk", q, k) / 2.0
    p = np.exp(logits - logits.max(-1, keepdims=True))
    ref = np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), w)
    got = layers.attention_matmul(*(jnp.asarray(a, jnp.float32) for a in (q, k, w)), jnp.float32)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


NORM_EINSUMS = {"dtn": {"ijd,dh->hij", "zab,cazd->zbcd"}}  # DTN's own (positional mixing)


def test_onnx_attention_is_matmuls_not_einsum(artifacts):
    """jax2onnx writes an einsum as ONNX ``Einsum`` (ONNX Runtime ran those 2.5x slower than
    the same products as ``MatMul``); the export traces attention as matmuls: no ``Einsum``
    but a norm's own, and per block the two attention products and the four dense layers as
    ``MatMul``, and the patch embedding (``layers.token_dense``)."""
    import onnx
    for key, path in artifacts["onnx"].items():
        nodes = onnx.load(path).graph.node
        ops = collections.Counter(n.op_type for n in nodes)
        eqs = {a.s.decode() for n in nodes if n.op_type == "Einsum" for a in n.attribute}
        norm = key.split("_folded")[0]
        assert eqs <= NORM_EINSUMS.get(norm, set()), (key, eqs)
        blocks = 3 if norm == "dtn" else 1
        assert ops["MatMul"] >= 6 * blocks + 1, (key, ops)
        # the qkv kernels and biases joined at export into constants, not on every call (the
        # joined bias was broadcast to the dynamic batch by an Expand)
        if key in ("ln", "dyt") or key.endswith("_folded"):  # unfolded UN/BN/DTN broadcast stats
            assert ops["Expand"] == 0, (key, ops)


def test_fold_says_the_input_normalization_was_folded():
    """export --fold of a LayerNorm run printed only "folded 0 norm slot(s) into the next Dense",
    though the pixels' affine went into the patch embedding: --fold looked like it did nothing."""
    from normvit_jax import models
    from normvit_jax.deploy import bundle
    from tests.conftest import tiny_demo_config
    c = tiny_demo_config()
    v = models.create(models.spec_of(c.model, 10)).init(
        jax.random.key(0), np.zeros((1, 8, 8, 3), np.float32), train=False)
    said = []
    bundle.from_variables(c, c.model, v, 10, fold=True, log=said.append)
    assert said[0].startswith("folded 0 norm slot(s) into the next Dense"), said
    assert said[1] == ("folded the input normalization (x / 255 * scale + shift) into the patch "
                       "embedding"), said


def test_a_scanned_model_exports_with_its_blocks_unrolled(tmp_path):
    """model.scan=True (blocks stacked under one nn.scan, which jax2onnx cannot trace): the bundle
    unrolls the blocks, and the ONNX artifact, run in ONNX Runtime, gives the probabilities of
    the scanned model's own serving function (folded too: RepBN)."""
    import onnxruntime as ort
    from normvit_jax import models
    from normvit_jax.data import stats
    from normvit_jax.deploy import artifact, bundle
    from tests.conftest import tiny_demo_config
    c = tiny_demo_config()
    c.model.update(scan=True, norm={"name": "repbn"})
    spec = models.spec_of(c.model, 10)
    assert spec.scan
    v = models.create(spec).init(jax.random.key(0), np.zeros((1, 8, 8, 3), np.float32), train=False)
    rng = np.random.default_rng(0)
    v = jax.tree.map(lambda a: np.asarray(a) + 0.1 * rng.standard_normal(np.shape(a)).astype(
        np.float32), v)
    img = np.random.default_rng(1).integers(0, 256, (4, 8, 8, 3), np.uint8)
    affine = bundle.from_variables(c, c.model, v, 10, log=None).affine
    logits = models.create(spec).apply(v, stats.model_input(img, affine), train=False)
    want = np.asarray(jax.nn.softmax(logits, axis=-1))  # the scanned model itself
    for fold in (False, True):
        b = bundle.from_variables(c, c.model, v, 10, fold=fold, log=None)
        assert not b.model.scan
        path = str(tmp_path / f"m{fold}.onnx")
        artifact.export_artifact(b, "onnx", path, log=None)
        got, got_logits = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(
            ["probabilities", "logits"], {"image": img})
        assert float(want.max() - want.min()) > 0.05
        # The noisy weights give logits up to ~60 (spread ~90), where float32 holds a logit to
        # ~4e-6 and the two runtimes' kernels sum in other orders: the logits within 32 ulps of
        # their largest value, the probabilities within half that (a softmax moves at most
        # 0.5 x the largest change of a logit difference). ORT's AVX-512 kernels measured 1.1e-4
        # on the logits and 1.3e-5 on the probabilities (2026-11-27), AVX2 ones below 1e-5.
        logit_tol = 32 * np.finfo(np.float32).eps * float(np.abs(logits).max())
        np.testing.assert_allclose(got_logits, logits, rtol=0, atol=logit_tol)
        np.testing.assert_allclose(got, want, atol=max(TOL, 0.5 * logit_tol))


def test_an_artifact_leaves_the_training_stream_layout_pin_out():
    """model.stream_layout pins the residual stream with a LayoutConstraint custom call (on a
    GPU by default): jax.export refused it there (found on an H200, 2026-11-27), and no other
    runtime has it. The bundle drops the pin; the graph has none and computes the same logits."""
    import dataclasses
    from normvit_jax import models
    from normvit_jax.deploy import bundle
    from tests.deploy_runs import demo_config
    c = demo_config("vit_ln")
    c.model.stream_layout = "row_major"  # pinned on any backend, as 'auto' is on a GPU
    pinned = models.create(models.spec_of(c.model, 3), 3)
    x = np.random.default_rng(0).integers(0, 256, (2, c.data.image_size, c.data.image_size, 3),
                                          dtype=np.uint8)
    variables = jax.jit(functools.partial(pinned.init, train=False))(  # one compile, not per op
        jax.random.PRNGKey(0), x.astype(np.float32))
    b = bundle.from_variables(c, c.model, variables, 3, log=None)
    assert b.model.stream_layout == "free"
    exp = stablehlo_format.exported(b, None)
    assert "LayoutConstraint" not in exp.mlir_module()
    with pytest.raises(Exception, match="LayoutConstraint"):  # the pinned model's graph
        stablehlo_format.export(bundle.serving_fn(dataclasses.replace(b, model=models.spec_of(
            c.model, 3))), stablehlo_format.input_spec(b, None))
    np.testing.assert_allclose(np.asarray(exp.call(x)["logits"]),
                               np.asarray(bundle.serving_fn(b)(x)["logits"]), rtol=1e-5,
                               atol=1e-6)
