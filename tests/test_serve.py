"""Issue 34, point 4: ``python -m normvit_jax.serve`` on an ONNX artifact, with real HTTP requests
on localhost: predictions equal ONNX Runtime's on the same pixels, any image size and mode,
one-line 4xx JSON errors for bad input (and the service keeps serving), 100 concurrent requests
all answered correctly."""
from __future__ import annotations

import concurrent.futures
import functools
import io
import json
import os
import subprocess
import sys
import time
import types
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from configs import vit_ln
from normvit_jax.deploy import artifact, bundle, preprocess
from tests.conftest import REPO_ROOT

MAX_BYTES, MAX_PIXELS = 200_000, 1_000_000


def _tiny_artifact(out: str, names: list[str] | None = None, fmt: str = "onnx",
                   log=None, batch: int | None = None) -> None:
    """A one-block demo ViT with random weights (drawn in numpy at the shapes ``init`` gives, so
    nothing is compiled) and a wide random head (so predictions vary)."""
    import jax
    from normvit_jax import models
    c = vit_ln.get_config("demo")
    c.model.update(hidden_size=32, depth=1, num_heads=2, mlp_dim=64)
    shapes = jax.eval_shape(functools.partial(models.create(c.model, 10).init, train=False),
                            jax.random.key(0), np.zeros((1, 8, 8, 3), np.float32))
    rng = np.random.default_rng(0)
    v = jax.tree.map(lambda s: rng.normal(0, 0.2, s.shape).astype(s.dtype), shapes)
    v["params"]["head"]["kernel"] = rng.normal(0, 0.5, shapes["params"]["head"]["kernel"].shape
                                               ).astype(np.float32)
    names = names or [f"digit {i}" for i in range(10)]
    artifact.export_artifact(bundle.from_variables(c, c.model, v, 10, names, log=None), fmt,
                             out, batch=batch, log=log)


def _start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "normvit_jax.serve", *args], cwd=REPO_ROOT,
                            env={**os.environ, "PYTHONPATH": REPO_ROOT},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _start_with_sigint_handled(path: str) -> subprocess.Popen:
    """The service on a free port, with Python's SIGINT handler set first, as in a terminal (a
    child of a background job, as pytest's may be, inherits SIGINT ignored)."""
    return subprocess.Popen(
        [sys.executable, "-c", "import runpy, signal, sys; "
         "signal.signal(signal.SIGINT, signal.default_int_handler); sys.argv[0] = 'serve'; "
         "runpy.run_module('normvit_jax.serve', run_name='__main__')",
         f"--artifact={path}", "--port=0"],
        cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": REPO_ROOT},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("artifact") / "model.onnx")
    _tiny_artifact(path)
    proc = _start(f"--artifact={path}", "--port=0", f"--max_bytes={MAX_BYTES}",
                  f"--max_pixels={MAX_PIXELS}")
    try:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()[-3000:]
        url = json.loads(line)["url"]
        import onnxruntime as ort
        session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        yield url, session, artifact.read_metadata(path)[0], path
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _post(url: str, body: bytes, query: str = "", content_type: str | None = None
          ) -> tuple[int, dict]:
    req = urllib.request.Request(f"{url}/predict{query}", data=body, method="POST")
    if content_type:
        req.add_header("Content-Type", content_type)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _multipart(field: str, data: bytes) -> tuple[bytes, str]:
    boundary = "----normvit-test-boundary"
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"{field}\"; "
            f"filename=\"x.png\"\r\nContent-Type: application/octet-stream\r\n\r\n").encode()
    return body + data + f"\r\n--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def _encode(a: np.ndarray, fmt: str = "PNG", mode: str | None = None) -> bytes:
    buf = io.BytesIO()
    im = Image.fromarray(a) if mode == "I;16" else Image.fromarray(a, mode)  # uint16: 16-bit
    assert mode is None or im.mode == mode
    im.save(buf, format=fmt)
    return buf.getvalue()


def _expected(session, x: np.ndarray, k: int) -> list[tuple[int, float]]:
    p = session.run(["probabilities"], {"image": x[None]})[0][0]
    order = np.argsort(-p, kind="stable")[:k]
    return [(int(i), float(p[i])) for i in order]


def _check(got: dict, want: list[tuple[int, float]]) -> None:
    preds = got["predictions"]
    assert [p["index"] for p in preds] == [i for i, _ in want]
    assert [p["label"] for p in preds] == [f"digit {i}" for i, _ in want]
    np.testing.assert_allclose([p["probability"] for p in preds], [q for _, q in want], atol=1e-6)


def test_predictions_are_the_runtimes_on_the_pixels(served):
    url, session = served[:2]
    rng = np.random.default_rng(1)
    x = rng.integers(0, 256, (8, 8, 3), np.uint8)  # at the model's size: sent as it is
    status, got = _post(url, _encode(x), "?top_k=3")
    assert status == 200 and len(got["predictions"]) == 3
    _check(got, _expected(session, x, 3))
    body, ctype = _multipart("file", _encode(x))
    status, got = _post(url, body, "", ctype)  # multipart, default top_k 5
    assert status == 200
    _check(got, _expected(session, x, 5))


def _photo(h: int, w: int, seed: int) -> np.ndarray:
    """Smooth colours plus grain (a JPEG of noise alone hides chroma effects in the noise)."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (h // 8 + 1, w // 8 + 1, 3), np.uint8)
    img = np.asarray(Image.fromarray(small).resize((w, h), Image.BILINEAR), np.float32)
    return np.clip(img + rng.normal(0, 12, img.shape), 0, 255).astype(np.uint8)


def _predicts_pixels(path: Path, config) -> np.ndarray:
    """What ``python -m normvit_jax.predict`` feeds the model for the file (its own code)."""
    from normvit_jax import predict
    from normvit_jax.data import tf_images
    kept, x, skipped = predict._decode([str(path)], predict.eval_geometry(config.data),
                                       tf_images.BatchDecoder(1))
    assert kept == [str(path)] and not skipped
    return x[0]


@pytest.mark.parametrize("shape, fmt, mode", [
    ((480, 640, 3), "JPEG", None), ((40, 48, 3), "JPEG", None), ((17, 33), "PNG", "L"),
    ((300, 5, 4), "PNG", "RGBA"), ((1, 1, 3), "PNG", None), ((40, 30), "GIF", "L"),
    ((20, 24), "PNG", "I;16"), ((3, 10000, 3), "PNG", None), ((36, 52, 3), "WEBP", None)])
def test_any_size_and_mode_gets_predicts_pixels(served, tmp_path, shape, fmt, mode):
    """The service's answer is the artifact on exactly the pixels predict (and evaluation) makes
    of the same file. Serving decoded with PIL and resized in numpy: a 4:2:0 JPEG whose central
    crop ends inside it (40x48) differed in a column by up to 20 levels (TensorFlow decodes only
    the window), and resized pixels by one level of rounding here and there."""
    url, session, meta = served[:3]
    if mode in ("L", "RGBA", "I;16"):
        a = np.random.default_rng(2).integers(0, 65536 if mode == "I;16" else 256, shape).astype(
            np.uint16 if mode == "I;16" else np.uint8)
    else:
        a = _photo(shape[0], shape[1], 2)
    data = _encode(a, fmt, mode)
    (tmp_path / "image").write_bytes(data)
    x = _predicts_pixels(tmp_path / "image", vit_ln.get_config("demo"))  # the artifact's config
    np.testing.assert_array_equal(preprocess.to_input(data, meta["preprocess"], MAX_PIXELS), x)
    status, got = _post(url, data, "?top_k=10")
    assert status == 200, got
    _check(got, _expected(session, x, 10))


def test_a_jpegs_eval_pixels_are_predicts_at_every_crop(tmp_path):
    """Photo-sized JPEGs under a cropping geometry (ImageNet's 0.875 central crop to 224, bicubic;
    big_vision's resize_small): pixel for pixel what predict makes of the file."""
    from configs import vit_ln as cfg_module
    for k, (h, w, fraction, small, interpolation) in enumerate([
            (375, 500, 0.875, 0, "bicubic"), (333, 517, 0.875, 0, "bilinear"),
            (300, 257, 1.0, 256, "bilinear")]):
        c = cfg_module.get_config("demo")
        c.data.update(image_size=224, eval_crop_fraction=fraction, eval_resize_small=small,
                      interpolation=interpolation)
        data = _encode(_photo(h, w, k), "JPEG")
        (tmp_path / f"{k}.jpg").write_bytes(data)
        got = preprocess.to_input(data, bundle.eval_preprocess(c.data), 10**7)
        np.testing.assert_array_equal(got, _predicts_pixels(tmp_path / f"{k}.jpg", c))


def test_the_metadata_geometry_is_predicts():
    """preprocess.geometry of what the export writes (bundle.eval_preprocess) is predict's own
    eval geometry of the run's config, for each setting the geometry has."""
    from normvit_jax import predict
    for update in ({}, {"eval_crop_fraction": 0.875, "interpolation": "bicubic"},
                   {"interpolation": "random", "antialias": False}, {"eval_resize_small": 40}):
        c = vit_ln.get_config("demo")
        c.data.update(image_size=32, **update)
        assert preprocess.geometry(bundle.eval_preprocess(c.data)) == \
            predict.eval_geometry(c.data), update


def test_the_eval_resize_is_pils_antialiased_resize():
    """The geometry against PIL itself (the reference the eval pipeline follows): central square
    crop, antialiased bilinear resize; within one level of rounding."""
    rgb = np.random.default_rng(3).integers(0, 256, (48, 64, 3), np.uint8)
    got = preprocess.to_input(_encode(rgb), {"image_size": 8, "eval_crop_fraction": 1.0,
                                             "eval_resize_small": 0, "interpolation": "bilinear",
                                             "antialias": True}, MAX_PIXELS)
    want = np.asarray(Image.fromarray(rgb[:, 8:56]).resize((8, 8), Image.BILINEAR))
    assert np.abs(got.astype(int) - want).max() <= 1


def test_a_thin_strip_under_resize_small_is_refused_before_it_is_resized():
    """eval_resize_small scales the short side: a 3 x 10000 strip (30 kpx, under --max_pixels)
    became 256 x 853,333 before its central crop (numpy asked for a 64 GB weight matrix, the
    service died); now a 413 naming the resized size, nothing decoded."""
    pre = {"image_size": 224, "eval_crop_fraction": 1.0, "eval_resize_small": 256,
           "interpolation": "bilinear", "antialias": True}
    strip = _encode(np.zeros((3, 10000, 3), np.uint8))
    with pytest.raises(preprocess.InputError, match=r"image of 10000x3 is resized to 853333x256 = "
                       r"218,453,248 pixels \(eval_resize_small=256\), over the limit of "
                       r"1,000,000 pixels \(--max_pixels\)") as e:
        preprocess.to_input(strip, pre, MAX_PIXELS)
    assert e.value.status == 413
    assert preprocess.to_input(_encode(np.zeros((300, 400, 3), np.uint8)), pre,
                               MAX_PIXELS).shape == (224, 224, 3)  # a photo's shape still passes


def _bomb() -> bytes:
    """A decompression bomb at the test's scale: a 2000 x 2000 black PNG, a few kB that decode
    to 4 Mpx (over the service's --max_pixels of 1 Mpx here)."""
    return _encode(np.zeros((2000, 2000), np.uint8), "PNG", "L")


@pytest.mark.parametrize("body, query, ctype, status, message", [
    (b"", "", None, 400, "empty body"),
    (b"hello, not an image", "", None, 400, "not a readable image"),
    (b"\x89PNG\r\n\x1a\n" + b"\0" * 50, "", None, 400, "not a readable image"),
    (b"x" * (MAX_BYTES + 1), "", None, 413, "over the limit of 200,000 bytes"),
    ("bomb", "", None, 413, "2000x2000 = 4,000,000 pixels is over the limit"),
    ("png", "?top_k=0", None, 400, "top_k='0': must be an integer from 1 to 10"),
    ("png", "?top_k=11", None, 400, "top_k='11'"),
    ("png", "?top_k=abc", None, 400, "top_k='abc'"),
    ("png", "?top_k=1_0", None, 400, "top_k='1_0': must be an integer"),  # int() took these
    ("png", "?top_k=%20%203", None, 400, "top_k=' 3': must be an integer"),
    ("png", "?top_k=%2B3", None, 400, "top_k='+3': must be an integer"),
    ("png", "?top_k=3&top_k=1", None, 400, "top_k is given 2 times"),  # the last one was taken
    pytest.param("png", "?top_k=" + "9" * 5000, None, 400, "top_k='99999999999999999999'... "
                 "(5,000 characters): must be an integer",
                 id="top_k-of-5000-digits"),  # int() raised ValueError (over 4300 digits): a 500
    pytest.param("png", "?" + "&".join(f"top_k={i}" for i in range(1000)), None, 400,
                 "top_k is given 1,000 times ('0', '1', '2', ...): give it once",
                 id="top_k-1000-times"),  # each value was echoed: a client made the line huge
    ("multipart-other", "", "multipart", 400, "without a field named 'file'"),
    ("multipart-cut", "", "multipart", 400, "malformed multipart body: it ends before its "
     "closing boundary"),  # was "without a field named 'file'"
    (b"--nonsense", "", "multipart/form-data; boundary=zzz", 400, "malformed multipart body"),
])
def test_bad_input_is_a_one_line_4xx_and_the_service_keeps_serving(served, body, query, ctype,
                                                                     status, message):
    url, session = served[:2]
    png = _encode(np.zeros((8, 8, 3), np.uint8))
    if body == "bomb":
        body = _bomb()
        assert len(body) < 20_000
    elif body == "png":
        body = png
    elif body == "multipart-other":
        body, ctype = _multipart("image", png)
    elif body == "multipart-cut":
        body, ctype = _multipart("file", png)
        body = body[:-10]
    code, got = _post(url, body, query, ctype)
    assert code == status and message in got["error"], (code, got)
    assert "\n" not in got["error"] and set(got) == {"error"} and len(got["error"]) < 300
    with urllib.request.urlopen(f"{url}/healthz", timeout=30) as r:
        assert r.status == 200 and json.loads(r.read())["status"] == "ok"


def test_a_client_that_leaves_mid_body_is_no_error_of_the_app():
    """A client that disconnects before its body is complete: the app answers (to nobody) instead
    of raising starlette's ClientDisconnect, which uvicorn logged as a traceback."""
    import asyncio
    from normvit_jax import serve
    app = serve.make_app(types.SimpleNamespace(top_k=lambda raw: 1))
    scope = {"type": "http", "method": "POST", "path": "/predict", "query_string": b"",
             "headers": [(b"content-length", b"5")], "http_version": "1.1", "scheme": "http",
             "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 1), "root_path": ""}
    messages = [{"type": "http.request", "body": b"ab", "more_body": True},
                {"type": "http.disconnect"}]
    sent = []

    async def receive() -> dict:
        return messages.pop(0)

    async def send(message: dict) -> None:
        sent.append(message)
    asyncio.run(app(scope, receive, send))
    assert sent[0]["status"] == 400


def test_wrong_method_and_path_are_json_4xx(served):
    url = served[0]
    for req, code in ((urllib.request.Request(f"{url}/predict"), 405),
                      (urllib.request.Request(f"{url}/nothing"), 404),
                      # starlette's redirect_slashes answered these 307 (to /predict, /healthz)
                      (urllib.request.Request(f"{url}/predict/", data=b"x"), 404),
                      (urllib.request.Request(f"{url}/healthz/"), 404)):
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=30)
        assert e.value.code == code and "error" in json.loads(e.value.read())


def test_100_concurrent_requests_are_all_answered_correctly(served):
    url, session = served[:2]
    rng = np.random.default_rng(4)
    xs = [rng.integers(0, 256, (8, 8, 3), np.uint8) for _ in range(10)]
    want = [_expected(session, x, 3) for x in xs]

    def one(i: int) -> tuple[int, int, dict]:
        data = _encode(xs[i % 10])
        if i % 2:
            body, ctype = _multipart("file", data)
            return (i,) + _post(url, body, "?top_k=3", ctype)
        return (i,) + _post(url, data, "?top_k=3")
    with concurrent.futures.ThreadPoolExecutor(max_workers=100) as pool:
        results = list(pool.map(one, range(100)))
    assert len(results) == 100 and all(code == 200 for _, code, _ in results), \
        [r for r in results if r[1] != 200][:3]
    for i, _, got in results:
        _check(got, want[i % 10])


def _serve_main(args: list[str], capsys) -> tuple[int, str]:
    """The command's ``main`` in this process, for an error before it serves: (exit status,
    stderr). An exception other than its exit fails the test (a traceback in a real process)."""
    from normvit_jax import serve
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        serve.main(args)
    return e.value.code, capsys.readouterr().err


def test_command_errors_are_one_line_exit_2(tmp_path, served, capsys):
    """The first error as typed, in a process (its real exit status and stderr; also
    test_a_port_in_use_is_said_before_the_model_loads); the others through the command's main in
    this process, which ends in the same one-line exit; a tiny --max_pixels is served in
    test_ctrl_c_of_a_background_job_is_one_line_and_130_too."""
    r = _start(f"--artifact={tmp_path / 'missing.onnx'}")
    _, err = r.communicate(timeout=120)
    assert r.returncode == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(
        f"python -m normvit_jax.serve: error: {tmp_path / 'missing.onnx'} does not exist: pass ")
    damaged = tmp_path / "damaged"  # the artifact's files, its .onnx cut short
    damaged.mkdir()
    for name in ("model.onnx.json", "classes.json"):
        (damaged / name).write_bytes((Path(served[3]).parent / name).read_bytes())
    (damaged / "model.onnx").write_bytes(Path(served[3]).read_bytes())
    (damaged / "model.onnx.json").write_text('{"format": "onn')
    code, err = _serve_main([f"--artifact={damaged / 'model.onnx'}"], capsys)
    assert code == 2 and "Traceback" not in err, err[-2000:]
    assert err.strip().splitlines()[-1].startswith(
        f"python -m normvit_jax.serve: error: {damaged / 'model.onnx.json'} is not readable JSON")
    (damaged / "model.onnx.json").write_bytes((Path(served[3]).parent / "model.onnx.json"
                                               ).read_bytes())
    (damaged / "model.onnx").write_bytes(Path(served[3]).read_bytes()[:1000])
    code, err = _serve_main([f"--artifact={damaged / 'model.onnx'}"], capsys)
    assert code == 2 and "Traceback" not in err, err[-2000:]
    assert err.strip().splitlines()[-1].startswith(
        f"python -m normvit_jax.serve: error: {damaged / 'model.onnx'} cannot be loaded by "
        "onnxruntime (InvalidProtobuf: ")
    code, err = _serve_main([f"--artifact={served[3]}", "--threads=-1", "--workers=0"], capsys)
    assert code == 2 and err.strip().splitlines()[-1].startswith(
        "python -m normvit_jax.serve: error: --workers=0, --threads=-1 is not accepted; "), err
    port = int(served[0].rsplit(":", 1)[1])  # taken by the running service
    code, err = _serve_main([f"--artifact={served[3]}", f"--port={port}"], capsys)
    assert code == 2 and f"cannot listen on 127.0.0.1:{port}" in err, err[-2000:]


def test_onnx_sessions_spin_by_default_and_can_sleep_between_calls(monkeypatch, tmp_path):
    """serve keeps ONNX Runtime's default (threads busy-wait for the next call: lowest latency);
    spin=False, for sessions called in turn on few cores (benchmarks/deploy.py), turns it off."""
    ort = pytest.importorskip("onnxruntime")
    from normvit_jax.deploy import runtimes
    seen = []

    class Session:
        def __init__(self, path, opts, providers):
            seen.append(opts)

        def get_outputs(self):
            return []
    monkeypatch.setattr(ort, "InferenceSession", Session)
    path = tmp_path / "m.onnx"
    path.write_bytes(b"")
    runtimes.open_artifact(str(path), "onnx", threads=2, spin=False)
    runtimes.open_artifact(str(path), "onnx", threads=2)
    assert seen[0].get_session_config_entry("session.intra_op.allow_spinning") == "0"
    assert seen[0].intra_op_num_threads == seen[1].intra_op_num_threads == 2
    with pytest.raises(RuntimeError, match="allow_spinning"):  # not set: ONNX Runtime's default
        seen[1].get_session_config_entry("session.intra_op.allow_spinning")


def test_a_savedmodel_never_replaces_a_folder_of_other_files(tmp_path):
    """The SavedModel writer replaces its --out folder: a run's workdir or '.' given by mistake
    was deleted. Such a folder is refused before anything is written; an empty one is used."""
    from normvit_jax.deploy import DeployError
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "config.json").write_text("{}")
    with pytest.raises(DeployError, match=r"holds other files than a SavedModel written by this "
                                          r"export, .* pass a new or empty folder"):
        _tiny_artifact(str(tmp_path / "run"), fmt="savedmodel")
    assert sorted(os.listdir(tmp_path / "run")) == ["checkpoints", "config.json"]
    assert sorted(os.listdir(tmp_path)) == ["run"]  # no .tmp, no staging folder left


def test_a_savedmodels_log_says_its_side_files_are_in_it(tmp_path, monkeypatch):
    """The log said classes.json and deploy.json were 'beside it'; they are in the folder. (The
    writer is replaced: the line is checked, not TensorFlow.)"""
    monkeypatch.setattr(artifact, "_writer", lambda fmt: lambda b, out, batch, meta:
                        os.makedirs(out))
    lines = []
    _tiny_artifact(str(tmp_path / "sm"), fmt="savedmodel", log=lines.append)
    assert lines[0].endswith(f"; {tmp_path / 'sm' / 'classes.json'} and "
                             f"{tmp_path / 'sm' / 'deploy.json'} in it"), lines
    assert sorted(os.listdir(tmp_path / "sm")) == ["classes.json", "deploy.json"]


def test_ctrl_c_of_a_background_job_is_one_line_and_130_too(served):
    """`serve ... &` in a script starts with SIGINT ignored; uvicorn stopped on `kill -INT` anyway
    and re-raised it into the ignored disposition: exit 0, no line (the foreground's is 130)."""
    import signal
    proc = subprocess.Popen([sys.executable, "-m", "normvit_jax.serve", f"--artifact={served[3]}",
                             "--port=0", "--max_pixels=3"], cwd=REPO_ROOT,  # a tiny limit is valid
                            env={**os.environ, "PYTHONPATH": REPO_ROOT},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()[-2000:]  # serving
        assert json.loads(line)["format"] == "onnx", line  # (test_command_errors_are_one_line_...)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130 and "Traceback" not in err, (proc.returncode, err)
    assert err.strip().splitlines()[-1] == \
        "python -m normvit_jax.serve: interrupted (Ctrl-C); stopped"


_SLOW_GC_BEFORE_SERVING = """
import gc, runpy, sys, time
import uvicorn
run = uvicorn.Server.run

def slow_collection_then_run(self, *args, **kwargs):
    # a garbage collection whose callback (JAX has one) runs Python when the test's Ctrl-C comes
    def callback(phase, info):
        end = time.time() + 2.0
        while phase == "start" and time.time() < end:
            pass
    gc.callbacks.append(callback)
    gc.collect()
    gc.callbacks.remove(callback)
    return run(self, *args, **kwargs)

uvicorn.Server.run = slow_collection_then_run
sys.argv[0] = "serve"
runpy.run_module("normvit_jax.serve", run_name="__main__")
"""


def test_ctrl_c_during_a_garbage_collection_callback_still_stops_the_service(served):
    """Python's default handler raised KeyboardInterrupt in whatever ran: in a gc callback it is
    ignored ("Exception ignored in: <function _xla_gc_callback>"), and a Ctrl-C sent right after
    the serving line left the service running for good (2 of 40 tries here, with no hook). Until
    uvicorn's handler is in place, serve's own handler records the signal and stops the server."""
    import signal
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_GC_BEFORE_SERVING,
                             f"--artifact={served[3]}", "--port=0"], cwd=REPO_ROOT,
                            env={**os.environ, "PYTHONPATH": REPO_ROOT},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()[-2000:]
        time.sleep(0.3)  # the collection has begun (the line comes just before it)
        proc.send_signal(signal.SIGINT)  # within its callback's 2 s
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130 and "Traceback" not in err, (proc.returncode, err[-2000:])
    assert err.strip().splitlines()[-1] == \
        "python -m normvit_jax.serve: interrupted (Ctrl-C); stopped"


def test_artifacts_sharing_a_folder_keep_their_class_names(tmp_path):
    """ONNX/StableHLO files in one folder share its classes.json: a model with other class names
    is refused there before anything is written (it would have relabelled the others); the same
    path may be re-exported; a classes.json that does not fit the artifact is named on reading."""
    from normvit_jax.deploy import DeployError
    first = [f"digit {i}" for i in range(10)]
    other = [f"letter {c}" for c in "abcdefghij"]
    _tiny_artifact(str(tmp_path / "a.onnx"))
    _tiny_artifact(str(tmp_path / "a2.onnx"))  # the same classes: shared without harm
    with pytest.raises(DeployError, match=r"classes.json holds the class names of a.onnx and 1 "
                       r"more, not this model's \(10 classes\): export it to another folder"):
        _tiny_artifact(str(tmp_path / "b.onnx"), other)
    assert not (tmp_path / "b.onnx").exists() and not (tmp_path / "b.onnx.json").exists()
    assert artifact.read_metadata(str(tmp_path / "a.onnx"))[1] == first
    _tiny_artifact(str(tmp_path / "c" / "b.onnx"), other)  # a folder of its own
    assert artifact.read_metadata(str(tmp_path / "c" / "b.onnx"))[1] == other
    (tmp_path / "a2.onnx").unlink()
    _tiny_artifact(str(tmp_path / "a.onnx"), other)  # alone in the folder: re-exported
    assert artifact.read_metadata(str(tmp_path / "a.onnx"))[1] == other
    (tmp_path / "classes.json").write_text(json.dumps(other[:3]))
    with pytest.raises(DeployError, match=r"classes.json names 3 classes, the artifact .*a.onnx "
                       r"has 10: it belongs to another artifact"):
        artifact.read_metadata(str(tmp_path / "a.onnx"))


def test_an_artifacts_side_files_of_another_shape_are_named(tmp_path):
    """serve reads an artifact's classes.json and metadata: valid JSON of another shape (a number,
    a list) was a TypeError/AttributeError traceback; now a DeployError naming the file."""
    from normvit_jax.deploy import DeployError
    path = str(tmp_path / "a.onnx")
    _tiny_artifact(path)
    (tmp_path / "classes.json").write_text("5")
    with pytest.raises(DeployError, match=rf"^{tmp_path}/classes.json is not a list of class "
                                          r"names \(JSON int\); export the artifact again$"):
        artifact.read_metadata(path)
    (tmp_path / "classes.json").write_text(json.dumps([f"digit {i}" for i in range(10)]))
    (tmp_path / "a.onnx.json").write_text("[]")
    with pytest.raises(DeployError, match=rf"^{path}.json is not an artifact's metadata"):
        artifact.read_metadata(path)


def test_ctrl_c_stops_the_service_with_one_line_and_130(served):
    """Ctrl-C while serving: uvicorn shuts down, then re-raises SIGINT, which was a
    KeyboardInterrupt traceback and a death by signal; now one line and exit 130 (docs/faults.md).
    SIGTERM (docker stop, systemd) ends it quietly by the signal, as uvicorn does. Either one
    with a client that stopped mid-body: the shutdown waited for it forever; now the requests in
    flight get serve.SHUTDOWN_GRACE_S, and the cancelled one is no traceback in the log."""
    import signal
    import socket
    from normvit_jax import serve
    signals = ((signal.SIGINT, 130), (signal.SIGTERM, -signal.SIGTERM))
    procs, stalled = [], []
    try:  # both services at once: each waits out its grace (SHUTDOWN_GRACE_S) in parallel
        for _ in signals:
            procs.append(_start_with_sigint_handled(served[3]))
        for (sig, _), proc in zip(signals, procs):
            line = proc.stdout.readline()
            assert line, proc.stderr.read()[-2000:]  # serving
            port = int(json.loads(line)["url"].rsplit(":", 1)[1])
            stalled.append(socket.create_connection(("127.0.0.1", port), timeout=30))
            stalled[-1].sendall(b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n"
                                b"\r\n" + b"x" * 10)
            with urllib.request.urlopen(f"{served[0].rsplit(':', 1)[0]}:{port}/healthz",
                                        timeout=30) as r:  # the stalled body is being read
                assert r.status == 200
            proc.send_signal(sig)
        for (sig, code), proc in zip(signals, procs):
            try:  # a hang is what is tested, not a time: the grace plus start-up slack
                _, err = proc.communicate(timeout=serve.SHUTDOWN_GRACE_S + 60)
            except subprocess.TimeoutExpired:
                pytest.fail(f"{sig!r}: the service did not stop with a stalled client")
            assert proc.returncode == code and "Traceback" not in err, (sig, proc.returncode, err)
            if sig == signal.SIGINT:
                assert err.strip().splitlines()[-1] == \
                    "python -m normvit_jax.serve: interrupted (Ctrl-C); stopped"
    finally:
        for conn in stalled:
            conn.close()
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


def test_an_ipv6_host_prints_a_url_that_works(served):
    """--host=::1 printed http://::1:PORT (not a URL: clients and the line's readers failed);
    now http://[::1]:PORT, and --host=[::1], as URLs write it, is accepted."""
    import socket
    try:
        socket.socket(socket.AF_INET6).bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    procs = [_start(f"--artifact={served[3]}", "--port=0", f"--host={host}")
             for host in ("::1", "[::1]")]  # both start up at once
    try:
        for proc in procs:
            line = proc.stdout.readline()
            assert line, proc.stderr.read()[-2000:]
            url = json.loads(line)["url"]
            assert url.startswith("http://[::1]:"), url
            with urllib.request.urlopen(f"{url}/healthz", timeout=30) as r:
                assert r.status == 200
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=30)


def test_a_port_in_use_is_said_before_the_model_loads(served, tmp_path):
    """The port is bound first: a taken one is the error at once, not after loading a model
    (TensorFlow for a SavedModel: 10 s and more)."""
    port = int(served[0].rsplit(":", 1)[1])
    r = _start(f"--artifact={tmp_path / 'not_loaded.onnx'}", f"--port={port}")
    _, err = r.communicate(timeout=120)
    assert r.returncode == 2 and err.strip().splitlines()[-1] == (
        f"python -m normvit_jax.serve: error: cannot listen on 127.0.0.1:{port}: Address already "
        "in use"), err[-2000:]


def test_the_docs_digit_png_is_the_digit_the_demo_learnt(tmp_path):
    """docs/deploy.md's command that makes digit.png, run as written: scikit-learn's values
    0..16 scaled to 0..255 (the demo trains on value / 16). It multiplied by 16, so the
    brightest strokes (16 * 16 = 256) wrapped to black in uint8."""
    import re
    from sklearn.datasets import load_digits
    doc = (Path(REPO_ROOT) / "docs" / "deploy.md").read_text(encoding="utf-8")
    command = re.search(r'`python -c "([^"]*digit\.png[^"]*)"`', doc).group(1)
    subprocess.run([sys.executable, "-c", command], cwd=tmp_path, check=True, timeout=120)
    png = np.asarray(Image.open(tmp_path / "digit.png"), np.float64)
    digit = load_digits().images[7]
    assert png.shape == (8, 8) and digit.max() == 16  # the case that wrapped
    np.testing.assert_allclose(png / 255, digit / 16, rtol=0, atol=0.5 / 255)


def test_the_metadata_states_the_decoding_rules_the_project_follows():
    """The metadata's ``preprocess`` gave the geometry only: a consumer outside this project could
    not know that EXIF orientation is applied, alpha dropped (not composited), the first frame
    taken, 16-bit values mapped how, gray repeated, the aspect ratio kept. Each rule is written
    in ``preprocess['decode']``, and a PIL reference that follows the written rules literally
    gives the pixels of the project's own decode (prepare's rule, then TensorFlow's decoder)."""
    import struct
    import zlib
    import tensorflow as tf
    from PIL import ImageOps
    from normvit_jax.data import images
    rules = bundle.eval_preprocess(vit_ln.get_config("demo").data)["decode"]
    assert rules == {"orientation": "exif", "frames": "first", "alpha": "dropped",
                     "gray": "repeated", "palette": "looked_up",
                     "bit_depth_16": {"gray": "round(v * 255 / 65535)", "color": "v >> 8"},
                     "color_profile": "ignored", "aspect_ratio": "kept"}
    rng = np.random.default_rng(5)

    def ours(data: bytes) -> np.ndarray:
        return tf.io.decode_image(images.as_stored(data), channels=3,
                                  expand_animations=False).numpy()

    def png16(v: np.ndarray) -> bytes:  # PIL writes no 16-bit colour PNG
        h, w = v.shape[:2]
        color = 2 if v.ndim == 3 else 0

        def chunk(kind: bytes, body: bytes) -> bytes:
            return (struct.pack(">I", len(body)) + kind + body
                    + struct.pack(">I", zlib.crc32(kind + body)))
        rows = b"".join(b"\x00" + v[y].astype(">u2").tobytes() for y in range(h))
        return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 16, color,
                                                                   0, 0, 0))
                + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))

    # orientation 'exif': the EXIF transpose applied (6: turned 90 degrees clockwise)
    px = rng.integers(0, 256, (6, 10, 3), np.uint8)
    exif = Image.Exif()
    exif[0x0112] = 6
    buf = io.BytesIO()
    Image.fromarray(px).save(buf, "PNG", exif=exif.tobytes())
    data = buf.getvalue()
    assert rules["orientation"] == "exif"
    want = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB"))
    assert want.shape == (10, 6, 3)
    np.testing.assert_array_equal(ours(data), want)
    # alpha 'dropped': the RGB under transparent pixels as they are
    rgba = rng.integers(0, 256, (5, 7, 4), np.uint8)
    rgba[..., 3] = 0
    assert rules["alpha"] == "dropped"
    np.testing.assert_array_equal(ours(_encode(rgba, "PNG")), rgba[..., :3])
    # frames 'first'
    frames = [Image.fromarray(np.full((4, 4, 3), c, np.uint8)) for c in (10, 200)]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:], duration=50)
    assert rules["frames"] == "first"
    np.testing.assert_array_equal(ours(buf.getvalue()),
                                  np.asarray(Image.open(io.BytesIO(buf.getvalue())).convert("RGB")))
    assert ours(buf.getvalue()).max() < 100
    # gray 'repeated'; palette 'looked_up'
    g = rng.integers(0, 256, (5, 6), np.uint8)
    assert rules["gray"] == "repeated"
    np.testing.assert_array_equal(ours(_encode(g, "PNG")), np.repeat(g[..., None], 3, -1))
    pal = Image.fromarray(px).convert("P", palette=Image.ADAPTIVE, colors=8)
    buf = io.BytesIO()
    pal.save(buf, "PNG")
    lut = np.array(pal.getpalette()[:8 * 3], np.uint8).reshape(-1, 3)
    np.testing.assert_array_equal(ours(buf.getvalue()), lut[np.asarray(pal)])
    # bit_depth_16: gray round(v * 255 / 65535), colour the high byte
    v = rng.integers(0, 65536, (4, 5), np.uint16)
    np.testing.assert_array_equal(
        ours(png16(v)), np.repeat(np.rint(v.astype(np.float64) * 255 / 65535).astype(np.uint8)[..., None], 3, -1))
    v3 = rng.integers(0, 65536, (4, 5, 3), np.uint16)
    np.testing.assert_array_equal(ours(png16(v3)), (v3 >> 8).astype(np.uint8))
    # aspect_ratio 'kept': a 20x40 image red at its sides, blue in its central 20x20
    wide = np.zeros((20, 40, 3), np.uint8)
    wide[:, :10, 0] = wide[:, 30:, 0] = 255
    wide[:, 10:30, 2] = 255
    pre = bundle.eval_preprocess(vit_ln.get_config("demo").data)
    pre.update(image_size=8, eval_crop_fraction=1.0, eval_resize_small=0)
    got = preprocess.to_input(_encode(wide, "PNG"), pre, MAX_PIXELS)
    assert rules["aspect_ratio"] == "kept"
    assert (got[..., 0] == 0).all() and (got[..., 2] == 255).all()


def test_requests_connected_before_a_signal_are_all_answered(served):
    """SIGTERM/SIGINT closed the listening socket at once: connections the kernel had already
    accepted into its backlog (connected, not yet taken by uvicorn) were reset, and accepted ones
    whose request had not been read yet were closed unanswered (16 to 48 of 50 in a walk). Two
    kinds of client, each connected before the signal: 20 taken by the service before it (their
    request sent 0.3 s after the signal, once the shutdown has begun), and 20 that connect and
    send their whole request while the service is stopped (SIGSTOP: still in the backlog when
    the signal comes, then SIGCONT). Every one is answered 200 (/healthz: 503, stopping)."""
    import signal
    import socket
    png = _encode(np.zeros((8, 8, 3), np.uint8))
    request = (b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(png)
               + png)
    sigs = (signal.SIGTERM, signal.SIGINT)
    procs = [_start_with_sigint_handled(served[3]) for _ in sigs]  # both start up at once
    try:
        for sig, proc in zip(sigs, procs):
            conns = []
            try:
                line = proc.stdout.readline()
                assert line, proc.stderr.read()[-2000:]
                port = int(json.loads(line)["url"].rsplit(":", 1)[1])
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=30) as r:
                    assert r.status == 200
                for _ in range(20):  # connected and taken, no request yet
                    conns.append(socket.create_connection(("127.0.0.1", port), timeout=60))
                time.sleep(0.5)
                proc.send_signal(signal.SIGSTOP)
                for _ in range(20):  # in the backlog, with their whole request
                    conns.append(socket.create_connection(("127.0.0.1", port), timeout=60))
                    conns[-1].sendall(request)
                proc.send_signal(sig)
                proc.send_signal(signal.SIGCONT)
                time.sleep(0.3)
                conns[0].sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")  # stopping
                for c in conns[1:20]:
                    c.sendall(request)
                answers = []
                for c in conns:
                    data = b""
                    try:
                        while chunk := c.recv(65536):
                            data += chunk
                    except OSError as e:
                        data += repr(e).encode()
                    answers.append(data.split(b"\r\n", 1)[0])
                _, err = proc.communicate(timeout=serve_grace() + 60)
                assert answers == [b"HTTP/1.1 503 Service Unavailable"] + [
                    b"HTTP/1.1 200 OK"] * (len(conns) - 1), (sig, answers)
                assert "Traceback" not in err, err[-2000:]
            finally:
                for c in conns:
                    c.close()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                proc.communicate()


def serve_grace() -> int:
    from normvit_jax import serve
    return serve.SHUTDOWN_GRACE_S


def test_a_405_names_the_allowed_methods(served):
    """A 405 lacked the ``Allow`` header HTTP requires (the error handler dropped starlette's
    headers)."""
    url = served[0]
    for path, allow in (("/predict", {"POST"}), ("/healthz", {"GET", "HEAD"})):
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(urllib.request.Request(f"{url}{path}", method="PUT", data=b"x"),
                                   timeout=30)
        assert e.value.code == 405 and set(e.value.headers["Allow"].split(", ")) == allow, \
            e.value.headers  # starlette's order is a set's
        assert "error" in json.loads(e.value.read())


@pytest.mark.parametrize("blocked, call, want", [
    ("onnx", "from normvit_jax.deploy import onnx_format; onnx_format._jax2onnx()",
     "the onnx format needs the package 'onnx' (import 'onnx' failed, which jax2onnx imports: "),
    ("onnxruntime", "from normvit_jax.deploy import onnx_format; onnx_format._jax2onnx()",
     "the onnx format needs the package 'onnxruntime' (import 'onnxruntime' failed, which "
     "jax2onnx imports: "),
    ("python_multipart,multipart", "from normvit_jax import serve; serve.main(['--artifact=x', "
     "'--port=0'])", "python -m normvit_jax.serve: error: python -m normvit_jax.serve needs the "
     "package 'python-multipart' (import 'python_multipart' failed: "),
])
def test_a_missing_package_is_named_by_its_import_and_pip_name(blocked, call, want):
    """A missing onnx or onnxruntime was said as "needs the package 'jax2onnx'" (which imports
    them), and a missing python-multipart as 'multipart', a name pip does not install."""
    code = (f"import sys\nfor m in {blocked!r}.split(','): sys.modules[m] = None\n"
            f"from normvit_jax.deploy import DeployError\ntry:\n    {call}\n"
            "except DeployError as e:\n    print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                       text=True, timeout=300, env={**os.environ, "PYTHONPATH": REPO_ROOT})
    out = (r.stdout + r.stderr).strip().splitlines()
    assert out and out[-1].startswith(want), (r.stdout, r.stderr[-2000:])
    assert out[-1].endswith("; install the deploy extra: pip install -e '.[deploy]'"), out[-1]
    assert "Traceback" not in r.stderr


def test_a_fixed_batch_savedmodel_refuses_another_batch_in_a_few_lines(tmp_path):
    """export --format=savedmodel --batch=3 fed 1 or 4 images: TensorFlow does not check a
    signature's declared shape, and XlaCallModule failed with a 61 KB error holding the whole
    MLIR module. The signature checks the batch first (EnsureShape): a short error naming the
    shapes. Run as a user would, in a process without normvit_jax."""
    out = str(tmp_path / "sm")
    _tiny_artifact(out, fmt="savedmodel", batch=3)
    code = (
        "import sys, numpy as np, tensorflow as tf\n"
        f"f = tf.saved_model.load({out!r}).signatures['serving_default']\n"
        "print('ok', f(image=tf.zeros([3, 8, 8, 3], tf.uint8))['probabilities'].shape)\n"
        "for n in (1, 4):\n"
        "    try:\n"
        "        f(image=tf.zeros([n, 8, 8, 3], tf.uint8))\n"
        "        print('ran', n)\n"
        "    except tf.errors.InvalidArgumentError as e:\n"
        "        print('refused', n, len(str(e)), repr(str(e)))\n"
        "assert not [m for m in sys.modules if m.startswith('normvit_jax')]\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       cwd=tmp_path, env={k: v for k, v in os.environ.items()
                                          if k != "PYTHONPATH"})
    lines = [ln for ln in r.stdout.splitlines() if ln.split(" ")[0] in ("ok", "ran", "refused")]
    assert r.returncode == 0 and lines[0] == "ok (3, 10)", (r.stdout, r.stderr[-3000:])
    for n, line in zip((1, 4), lines[1:]):
        assert line.startswith(f"refused {n} "), line[:300]
        assert int(line.split(" ")[2]) < 1000, line[:300]
        assert f"Shape of tensor image [{n},8,8,3] is not compatible with expected shape " \
               "[3,8,8,3]" in line, line[:500]


def test_the_onnx_outputs_are_in_the_documented_order(served):
    """The ONNX graph's outputs came in key order (logits, probabilities); docs/deploy.md and the
    metadata list probabilities first, so session.run(None, ...) unpacked them swapped."""
    session, meta = served[1], served[2]
    assert [o.name for o in session.get_outputs()] == ["probabilities", "logits"]
    assert list(meta["outputs"]) == ["probabilities", "logits"]
    probs, logits = session.run(None, {"image": np.zeros((2, 8, 8, 3), np.uint8)})
    np.testing.assert_allclose(probs.sum(-1), 1.0, atol=1e-5)
    np.testing.assert_allclose(probs, np.exp(logits) / np.exp(logits).sum(-1, keepdims=True),
                               atol=1e-6)


def test_a_savedmodel_exports_into_tf_servings_numbered_version_folder(tmp_path):
    """TF Serving reads a model's base path's numbered version folders (base/1/saved_model.pb);
    docs/deploy.md gives the export command for it, whose --out is such a folder in folders
    that do not exist yet."""
    import re
    doc = (Path(REPO_ROOT) / "docs" / "deploy.md").read_text(encoding="utf-8")
    out = re.search(r"--format=savedmodel --out=(models/mymodel/1)\b", doc).group(1)
    _tiny_artifact(str(tmp_path / out), fmt="savedmodel", batch=1)
    assert (tmp_path / "models" / "mymodel" / "1" / "saved_model.pb").is_file()
    assert sorted(p.name for p in (tmp_path / "models" / "mymodel").iterdir()) == ["1"]
    assert artifact.read_metadata(str(tmp_path / out))[0]["format"] == "savedmodel"


def test_the_docs_preprocess_reference_gives_the_projects_pixels():
    """The metadata's preprocess gave the geometry's settings but not its exact ops (a JPEG's
    crop-window decode with the accurate integer DCT, the crop side's rounding, the resize's
    rounding to uint8): a consumer outside the project got pixels off by a few levels. The rules
    are written in preprocess ('decoder', 'crop', 'resize'), and docs/deploy.md's TensorFlow
    reference, which follows them, gives the project's pixels exactly, for non-square JPEGs and
    PNGs under each geometry."""
    import re
    doc = (Path(REPO_ROOT) / "docs" / "deploy.md").read_text(encoding="utf-8")
    code = re.search(r"```python\n(# preprocess reference.*?)```", doc, re.S).group(1)
    space: dict = {}
    exec(compile(code, "docs/deploy.md", "exec"), space)  # noqa: S102  the docs' own snippet
    rng = np.random.default_rng(11)
    files = []
    for h, w in ((24, 40), (48, 64), (40, 24)):
        rgb = rng.integers(0, 256, (h, w, 3), np.uint8)
        buf = io.BytesIO()
        Image.fromarray(rgb).save(buf, "JPEG", quality=90)
        files += [buf.getvalue(), _encode(rgb, "PNG")]
    for update in ({"eval_crop_fraction": 0.875}, {"eval_crop_fraction": 0.9, "antialias": False},
                   {"interpolation": "bicubic", "eval_crop_fraction": 0.8},
                   {"interpolation": "random"}, {"eval_resize_small": 12}):
        c = vit_ln.get_config("demo")
        c.data.update(image_size=10, **update)
        pre = bundle.eval_preprocess(c.data)
        assert pre["decoder"]["jpeg"].endswith("dct_method='INTEGER_ACCURATE')")
        assert ("side = max(round(eval_crop_fraction * min(h, w)), 1)" in pre["crop"]["window"]
                ) != bool(pre["eval_resize_small"])
        for data in files:
            np.testing.assert_array_equal(space["pixels"](data, json.loads(json.dumps(pre))),
                                          preprocess.to_input(data, pre, MAX_PIXELS), update)


def test_a_malformed_multipart_body_logs_nothing_and_says_so_in_one_line(caplog):
    """python-multipart logged a warning line per malformed body ("Expected boundary character
    45, got 106 at index 2"): any client could flood the service's log. And the answer read
    "malformed multipart body: 400: Invalid multipart data." (the exception's status in it)."""
    import asyncio
    import logging
    from normvit_jax import serve
    caplog.set_level(logging.DEBUG)
    app = serve.make_app(types.SimpleNamespace(top_k=lambda raw: 1))
    body = (b"junk\r\n--zzz\r\nContent-Disposition: form-data; name=\"file\"\r\n\r\nabc\r\n"
            b"--zzz--\r\n")
    scope = {"type": "http", "method": "POST", "path": "/predict", "query_string": b"",
             "headers": [(b"content-type", b"multipart/form-data; boundary=zzz"),
                         (b"content-length", str(len(body)).encode())],
             "http_version": "1.1", "scheme": "http", "server": ("127.0.0.1", 8000),
             "client": ("127.0.0.1", 1), "root_path": ""}
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    sent = []

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)
    asyncio.run(app(scope, receive, send))
    assert sent[0]["status"] == 400
    assert json.loads(sent[1]["body"]) == {"error": "malformed multipart body: Invalid "
                                                    "multipart data."}
    assert not [r for r in caplog.records if "multipart" in r.name], caplog.records


def test_a_steady_stream_of_connections_after_a_signal_is_refused_within_a_second(served):
    """The shutdown took connections while the kernel's queue was non-empty at its polls: under a
    steady stream it went on taking connections made after the signal until the grace ended
    (docs/deploy.md: they are refused), and requests read near its end were cancelled (503).
    Now the queue is drained once (at most serve.SHUTDOWN_ACCEPT_S). 16 clients that connect
    again as soon as they are answered, from before the signal until the service stops (taken
    until 3.1 s after the signal before): none connected later than the drain (plus a wide
    margin) is answered; 10 connected before the signal, with their requests sent after it, are
    answered 200; the service stops within its grace (plus a wide margin)."""
    import signal
    import socket
    import threading
    from normvit_jax import serve
    png = _encode(np.zeros((8, 8, 3), np.uint8))
    request = (b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(png)
               + png)
    proc = _start(f"--artifact={served[3]}", "--port=0")
    before, streamed, stop = [], [], threading.Event()

    def answer(c) -> bytes:
        data = b""
        try:
            while chunk := c.recv(65536):
                data += chunk
        except OSError:  # reset: not answered
            pass
        return data.split(b"\r\n", 1)[0]

    def stream() -> None:  # a client that connects again as soon as it is answered
        while not stop.is_set():
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=60) as c:
                    connected = time.monotonic()
                    c.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                    streamed.append((connected, answer(c)))
            except OSError:  # refused, or reset in the queue when the port closed
                time.sleep(0.01)
    threads = [threading.Thread(target=stream, daemon=True) for _ in range(16)]
    try:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()[-2000:]
        port = int(json.loads(line)["url"].rsplit(":", 1)[1])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=30) as r:
            assert r.status == 200  # uvicorn serves (its signal handlers are set)
        for _ in range(10):  # taken before the signal, their request sent after it
            before.append(socket.create_connection(("127.0.0.1", port), timeout=60))
        for t in threads:
            t.start()
        time.sleep(0.5)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        for c in before:
            c.sendall(request)
        try:
            _, err = proc.communicate(timeout=serve.SHUTDOWN_GRACE_S + 60)
        except subprocess.TimeoutExpired:
            pytest.fail("the service did not stop under a stream of connections")
        stopped = time.monotonic() - signalled
        stop.set()
        for t in threads:
            t.join(60)
        assert [answer(c) for c in before] == [b"HTTP/1.1 200 OK"] * len(before)
        late = [a for connected, a in streamed  # the drain's end, plus a wide margin
                if connected > signalled + serve.SHUTDOWN_ACCEPT_S + 1.5]
        answered = [a for a in late if a]
        assert not answered, (len(answered), len(late), len(streamed), answered[:3])
        assert proc.returncode == -signal.SIGTERM, (proc.returncode, err[-2000:])
        assert stopped < serve.SHUTDOWN_GRACE_S + 10, stopped  # a hang, not a time, is tested
        assert "Traceback" not in err, err[-2000:]
    finally:
        stop.set()
        for c in before:
            c.close()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.mark.parametrize("http", ["auto", "h11", "httptools"])
def test_uvicorns_protocol_has_what_the_shutdown_reads(http):
    """serve._server_class's shutdown waits for the connections taken without a request yet by
    reading uvicorn's private ``protocol.cycle`` (None until a request's headers are read) and
    ``protocol.transport``, through getattr: a uvicorn that renamed them turned the wait into a
    no-op silently (those connections closed unanswered again). Each HTTP protocol uvicorn may
    pick (``auto``: httptools where installed, else h11) has them, as the shutdown reads them."""
    import asyncio
    import uvicorn
    from uvicorn.server import ServerState
    if http == "httptools":
        pytest.importorskip("httptools")
    config = uvicorn.Config(lambda scope, receive, send: None, http=http)
    config.load()
    loop = asyncio.new_event_loop()  # its own: another test's asyncio.run left none current
    protocol = config.http_protocol_class(config=config, server_state=ServerState(),
                                          app_state={}, _loop=loop)
    assert "cycle" in vars(protocol) and protocol.cycle is None, (http, sorted(vars(protocol)))

    class Transport:  # enough of asyncio's for connection_made
        def get_extra_info(self, name, default=None):
            return {"sockname": ("127.0.0.1", 1), "peername": ("127.0.0.1", 2)}.get(name)

        def is_closing(self) -> bool:
            return False

        def close(self) -> None:
            pass
    transport = Transport()
    protocol.connection_made(transport)
    try:
        assert protocol.transport is transport and protocol.cycle is None
        assert protocol in protocol.server_state.connections  # the set the shutdown reads
    finally:
        protocol.connection_lost(None)
        loop.close()
