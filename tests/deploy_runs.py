"""Builds what the deploy tests check, in one child process (one import of JAX, TensorFlow and
jax2onnx): ``python tests/deploy_runs.py OUT_DIR``.

- ``OUT/runs/<method>``: each method's ``:demo`` config (configs/<method>.py) shrunk to one
  32-wide block and trained 4 steps;
- ``OUT/images``: twelve real digits of the test split as the 8x8 PNG files a user would send;
- ``OUT/reference.npz``: ``python -m normvit_jax.predict``'s probabilities on them per run (its
  ``main``, all classes in class order);
- ``OUT/artifacts/<format>/<key>``: every run exported to ONNX, SavedModel and StableHLO
  (``deploy.export_artifact``), folded too where something folds (``keys``);
- ``OUT/manifest.json``: the paths, and what a Derf SavedModel export did (TF 2.21 cannot read
  JAX's ``erf`` composite: the one-line error, or the probabilities' sums if it ran); with jax
  0.11 (TF 2.21 cannot read its dynamic-batch SavedModel), the one-line errors, the SavedModels
  then written for the twelve images' fixed batch.

The tests run it with XLA_FAST: XLA's backend optimizations off, which cuts the compile time
that dominates such tiny runs by 3-6x and changes nothing the tests check (artifacts against
predict on the same checkpoint, at 1e-5)."""
from __future__ import annotations

import functools
import importlib
import json
import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _xla_fast() -> str:
    """XLA_FAST for the installed jaxlib: 0.11.2 does not know ``xla_cpu_use_fusion_emitters`` (XLA
    aborts the process on a flag it does not know). Read from the package metadata: JAX must not
    start before conftest sets XLA_FLAGS."""
    from importlib import metadata
    flags = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    try:
        major_minor = tuple(int(n) for n in metadata.version("jaxlib").split(".")[:2])
    except (metadata.PackageNotFoundError, ValueError):
        return flags
    return flags + (" --xla_cpu_use_fusion_emitters=false" if major_minor < (0, 11) else "")


XLA_FAST = _xla_fast()
METHODS = {"ln": "vit_ln", "un": "vit_un", "repbn": "vit_repbn", "progressive": "vit_progressive",
           "dyt": "vit_dyt", "dtn": "vit_dtn"}
FOLDS_ENTIRELY = ("un", "repbn", "progressive")  # every slot becomes the identity
FOLDS = FOLDS_ENTIRELY + ("dyt",)                 # DyT: its scale/bias fold, tanh stays
FORMATS = {"onnx": ".onnx", "savedmodel": ".savedmodel", "stablehlo": ".stablehlo"}
# A SavedModel runs the same jax.export module as the StableHLO artifact (inside XlaCallModule,
# weights as TF variables), where every folded model is checked: one folded SavedModel is enough
# to check the wrapping (each costs ~2 s CPU to write and load)
SAVEDMODEL_FOLDED = ("repbn",)


def folded_in(fmt: str) -> tuple[str, ...]:
    """The norms whose folded artifact is written (and checked) in ``fmt``."""
    return SAVEDMODEL_FOLDED if fmt == "savedmodel" else FOLDS


def keys(fmt: str) -> list[str]:
    """The artifacts of ``fmt``: every run, and '<norm>_folded' for ``folded_in(fmt)``."""
    return [k for norm in METHODS for k in (norm, norm + "_folded")
            if k == norm or norm in folded_in(fmt)]


def demo_config(method: str):
    """configs/<method>.py:demo, one 32-wide block (deeper where the demo places the class token
    counted from the end: DTN's -2 needs 3 blocks), 4 steps, a checkpoint at the end."""
    c = importlib.import_module(f"configs.{method}").get_config("demo")
    at = c.model.get("cls_token_at_block") or 0
    c.model.update(hidden_size=32, depth=max(1, 1 - at), num_heads=2, mlp_dim=64)
    c.update(total_steps=4, checkpoint_every=4, eval_every=4, log_every=4, eval_analysis_images=0)
    c.schedule.warmup_steps = 1
    c.optimizer.learning_rate = 1e-2  # a few steps that move the zero-initialised head enough
    # that the classes' probabilities differ by more than the tests' tolerance
    return c


def write_images(root: str, n: int = 12, stride: int = 29) -> list[str]:
    import numpy as np
    from PIL import Image
    from normvit_jax.data import digits
    os.makedirs(root, exist_ok=True)
    x, _ = digits.load("test")
    paths = []
    for i in range(0, n * stride, stride):
        paths.append(os.path.join(root, f"digit_{i:03d}.png"))
        Image.fromarray(np.rint(x[i] * 255).astype(np.uint8)).save(paths[-1])
    return paths


def reference(workdir: str, images: list[str]):
    """The predict command's probabilities, (images, classes) in class order."""
    import numpy as np
    from normvit_jax import predict
    rows, skipped = predict.main([f"--workdir={workdir}", "--images=" + ",".join(images),
                                  "--top_k=10", "--batch=16"])
    assert not skipped and [r["path"] for r in rows] == images
    with open(os.path.join(workdir, "classes.json"), encoding="utf-8") as f:
        names = json.load(f)
    return np.array([[dict(r["top"])[n] for n in names] for r in rows])


def derf_savedmodel(out: str) -> dict:
    """A Derf model (random weights) exported as a SavedModel: the error's text, or the sums of
    the probabilities the written SavedModel gives (a TF that reads JAX's erf composite)."""
    import jax
    import numpy as np
    from normvit_jax import models
    from normvit_jax.deploy import artifact, bundle, errors, runtimes
    c = demo_config("vit_derf")
    shapes = jax.eval_shape(functools.partial(models.create(c.model, 10).init, train=False),
                            jax.random.key(0), np.zeros((1, 8, 8, 3), np.float32))
    rng = np.random.default_rng(0)
    v = jax.tree.map(lambda s: rng.normal(0, 0.5, s.shape).astype(s.dtype), shapes)
    try:
        artifact.export_artifact(bundle.from_variables(c, c.model, v, 10, log=None),
                                 "savedmodel", out, batch=2, log=None)  # erf, not the batch
    except errors.UnsupportedOpError as e:
        return {"error": str(e), "written": os.path.exists(out)}
    probs, _ = runtimes.open_artifact(out, "savedmodel")(np.zeros((2, 8, 8, 3), np.uint8))
    return {"sums": np.asarray(probs).sum(1).tolist()}


_CPU_AT_LAST_STAGE = [0.0]


def _stage(name: str) -> None:
    """Prints the CPU seconds since the previous stage (where these tests' time goes)."""
    import resource
    r = resource.getrusage(resource.RUSAGE_SELF)
    print(f"{name}: {r.ru_utime + r.ru_stime - _CPU_AT_LAST_STAGE[0]:.1f} s CPU", flush=True)
    _CPU_AT_LAST_STAGE[0] = r.ru_utime + r.ru_stime


def main(out: str) -> None:
    import numpy as np
    from normvit_jax.deploy import artifact, bundle, errors
    from normvit_jax.train import loop
    runs = {norm: os.path.join(out, "runs", m) for norm, m in METHODS.items()}
    for norm, m in METHODS.items():
        loop.train_and_evaluate(demo_config(m), runs[norm])
        _stage(f"trained {m}")
    images = write_images(os.path.join(out, "images"))
    np.savez(os.path.join(out, "reference.npz"),
             **{norm: reference(wd, images) for norm, wd in runs.items()})
    _stage("predicted")
    artifacts: dict = {fmt: {} for fmt in FORMATS}
    dynamic_batch_errors: dict = {}
    for norm, wd in runs.items():
        for fold in (False, True) if norm in FOLDS else (False,):
            b = bundle.load(wd, fold=fold, log=None)
            key = norm + ("_folded" if fold else "")
            for fmt, ext in FORMATS.items():
                if key not in keys(fmt):
                    continue
                artifacts[fmt][key] = os.path.join(out, "artifacts", fmt, key + ext)
                try:
                    artifact.export_artifact(b, fmt, artifacts[fmt][key], log=None)
                except errors.DynamicBatchError as e:  # jax 0.11's SavedModel for TF 2.21
                    dynamic_batch_errors[key + "." + fmt] = str(e)
                    artifact.export_artifact(b, fmt, artifacts[fmt][key], batch=len(images),
                                             log=None)
                _stage(f"exported {key} as {fmt}")
    derf = derf_savedmodel(os.path.join(out, "artifacts", "derf.savedmodel"))
    _stage("Derf as a SavedModel")
    with open(os.path.join(out, "manifest.json"), "w", encoding="utf-8") as f:
        json.dump({"runs": runs, "images": images, "artifacts": artifacts, "derf": derf,
                   "dynamic_batch_errors": dynamic_batch_errors}, f)


if __name__ == "__main__":
    sys.path.insert(0, REPO_ROOT)
    main(sys.argv[1])
