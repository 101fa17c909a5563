"""The train loop end to end: checkpoints, summaries, exact resume, eval coverage, sharding."""
from __future__ import annotations

import glob
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from normvit_jax import checkpoints
from normvit_jax import run_config
from normvit_jax.train import loop, setup
from tests.conftest import REPO_ROOT, tiny_demo_config
from tests.deploy_runs import XLA_FAST

# Runs that compile the same programs again (a straight run, then stop + resume) load them from
# JAX's persistent compilation cache (tests/conftest.py: compile_cache) instead of compiling.
pytestmark = pytest.mark.usefixtures("compile_cache")


def _params(workdir):
    params, _ = checkpoints.load_params(workdir)
    return params


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """tiny_demo_config() trained to its end (6 steps, checkpoints at 3 and 6, eval at 6): the
    loop's returned dict and a function that copies its workdir for a test to change."""
    import shutil
    wd = tmp_path_factory.mktemp("finished") / "run"
    out = loop.train_and_evaluate(tiny_demo_config(), str(wd))
    return out, lambda dst: shutil.copytree(wd, dst, dirs_exist_ok=True)


def test_end_to_end_writes_checkpoints_summaries_and_resumes(finished_run, tmp_path):
    out, copy = finished_run
    copy(tmp_path)
    assert out["step"] == 6
    assert sorted(int(os.path.basename(p)) for p in glob.glob(str(tmp_path / "checkpoints" / "*"))
                  if os.path.basename(p).isdigit()) == [3, 6]
    assert glob.glob(str(tmp_path / "events.out.tfevents.*")), "no TensorBoard event file"
    assert (tmp_path / "config.json").exists()
    assert 0.0 <= out["eval"]["top1"] <= 1.0 and np.isfinite(out["eval"]["loss"])
    # A second call with more steps resumes at the saved step instead of starting over.
    cfg2 = tiny_demo_config(total_steps=8, allow_config_change=True)
    out2 = loop.train_and_evaluate(cfg2, str(tmp_path))
    assert out2["step"] == 8


def test_resume_is_bitwise_exact(tmp_path):
    """N steps straight == N/2, stop, N/2 more: identical parameters on CPU."""
    # one block: exactness holds at any depth, and each run compiles faster
    cfg = tiny_demo_config(total_steps=8, checkpoint_every=100, eval_every=100,
                           **{"model.depth": 1})
    cfg.model.dropout_rate = 0.1  # dropout draws must continue exactly too
    loop.train_and_evaluate(cfg, str(tmp_path / "a"))
    first = loop.train_and_evaluate(cfg, str(tmp_path / "b"), stop_at=4)
    assert first["step"] == 4
    second = loop.train_and_evaluate(cfg, str(tmp_path / "b"))
    assert second["step"] == 8
    a, b = _params(tmp_path / "a"), _params(tmp_path / "b")
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)


def test_eval_counts_every_example_once(finished_run):
    """355 digits test images with an eval batch of 64: 6 batches, the last padded and masked."""
    cfg = tiny_demo_config()  # finished_run's config: eval_batch_size=64
    assert cfg.eval_batch_size == 64
    out = finished_run[0]
    assert out["eval"]["num_examples"] == 355
    # Independent check of top-1 over the split with the final model, batch by batch in numpy.
    from normvit_jax import data, models
    pipe = data.make_pipeline(cfg, "eval")
    model = models.create(cfg.model, 10)
    state = out["state"]
    apply = jax.jit(model.apply)  # one compile, not one per operation (every batch is 64)
    correct, seen = 0, 0
    for batch in pipe.eval_batches():
        logits = np.asarray(apply(state.variables(), batch["image"]))
        m = batch["mask"].astype(bool)
        correct += int((logits.argmax(-1) == batch["label"])[m].sum())
        seen += int(m.sum())
    assert seen == 355
    assert out["eval"]["top1"] == pytest.approx(correct / 355, abs=1e-6)


@pytest.mark.parametrize("override,match", [
    ({"model.norm.name": "nonorm"}, "Unknown norm name 'nonorm'"),
    ({"model.name": "resnet"}, "model.name='resnet'"),
    ({"data.name": "mnist"}, "mnist"),
    ({"optimizer.name": "adagrad"}, "config.optimizer.name='adagrad'.*accepted"),
    ({"schedule.name": "step"}, "config.schedule.name='step'.*accepted"),
    ({"data.image_size": 9}, "config.data.image_size=9 is not divisible by the patch size 2"),
    ({"batch_size": 30, "grad_accum_steps": 4}, "grad_accum_steps=4"),
    ({"dtype": "float64"}, "config.dtype='float64'"),
])
def test_bad_config_values_fail_before_compilation(override, match):
    cfg = tiny_demo_config(**override)
    with pytest.raises(ValueError, match=match):
        setup.validate_config(cfg, num_devices=1)


def test_batch_not_divisible_by_devices_is_named():
    cfg = tiny_demo_config(batch_size=36)
    with pytest.raises(ValueError, match="batch_size=36 is not divisible by the number of devices \\(8\\)"):
        setup.validate_config(cfg, num_devices=8)


def test_unknown_key_on_the_command_line_is_named():
    r = subprocess.run([sys.executable, "main.py", "--config=configs/vit_ln.py:demo",
                        "--config.model.detph=3", "--workdir=/tmp/never"],
                       cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "config.model has no key 'detph'" in r.stderr and "'depth'" in r.stderr
    assert "Traceback" not in r.stderr


def test_config_change_is_refused_with_a_diff(finished_run, tmp_path):
    finished_run[1](tmp_path)  # a run of tiny_demo_config()
    with pytest.raises(run_config.ConfigChangedError, match="optimizer.learning_rate: 0.003 -> 0.01"):
        loop.train_and_evaluate(tiny_demo_config(**{"optimizer.learning_rate": 0.01}),
                                str(tmp_path))


def test_eight_devices_match_one_device():
    """One train step with the batch sharded over 8 CPU devices equals the 1-device step."""
    script = textwrap.dedent("""
        import jax, numpy as np
        from normvit_jax import models, sharding
        from normvit_jax.train import optimizer, steps
        from normvit_jax.train.setup import create_train_state
        from tests.conftest import tiny_demo_config
        assert jax.device_count() == 8
        cfg = tiny_demo_config(**{"model.depth": 1})  # one block: the sharding is the same
        model = models.create(cfg.model, 10)
        tx, lr = optimizer.create(cfg, 10)
        rng = np.random.default_rng(0)
        batch = {"image": rng.normal(size=(32, 8, 8, 3)).astype(np.float32),
                 "label": rng.integers(0, 10, 32).astype(np.int32)}
        out = {}
        for n in (1, 8):
            mesh = sharding.make_mesh(devices=jax.devices()[:n])
            state, ss = create_train_state(model, tx, (8, 8, 3), mesh, jax.random.key(0))
            step = jax.jit(steps.make_train_step(model, tx, lr), in_shardings=(ss, sharding.batch_sharding(mesh)))
            gb = sharding.to_global(batch, mesh)
            assert len(gb["image"].sharding.device_set) == n
            state, m = step(state, gb)
            state, m = step(state, gb)
            out[n] = (float(m.compute()["loss"]), jax.tree.map(np.asarray, state.params))
        np.testing.assert_allclose(out[1][0], out[8][0], rtol=1e-5)
        for a, b in zip(jax.tree.leaves(out[1][1]), jax.tree.leaves(out[8][1])):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
        print("OK")
    """)
    _run_on_cpu_devices(script, 8, timeout=300)


def test_setup_and_benchmarks_do_not_import_tensorflow():
    """normvit_jax.train.setup (and so the benchmarks) stays free of TensorFlow and the CLU
    writers (the whole loop does too: tests/test_tensorboard.py)."""
    code = ("import sys, normvit_jax.train.setup, benchmarks.common; "
            "print(sorted(m for m in ('tensorflow', 'clu.metric_writers', 'matplotlib') "
            "if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]", r.stdout


def test_loop_imports_the_eval_hook_only_when_enabled():
    """The eval-analysis hook (matplotlib figures) is imported by the loop only when
    config.eval_analysis_images or eval_attention_images asks for it."""
    code = "import sys, normvit_jax.train.loop; print('normvit_jax.analysis.eval_hook' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "False", r.stdout


def test_loop_with_fsdp_resumes_on_another_mesh_and_evaluates(tmp_path):
    """The whole loop with the state split over 'fsdp' (4 CPU devices): train 4 steps with
    mesh.fsdp=2, stop; resume replicated (mesh.fsdp=1, a key that may change on resume) to step 6;
    --mode=eval's evaluate_checkpoint restores it sharded again and gives the loop's last eval.
    Against a replicated run of 6 steps: parameters within 1e-4 relative to each array's scale
    (float32 reductions in another order; AdamW), but for arrays whose true gradient is zero (the
    attention key bias): AdamW turns their rounding noise into lr-sized steps, so they are only
    checked to stay below 1e-3."""
    script = textwrap.dedent(f"""
        import jax, numpy as np
        from normvit_jax import checkpoints, evaluation
        from normvit_jax.train import loop
        from tests.conftest import tiny_demo_config
        assert jax.device_count() == 4
        def cfg(fsdp):
            c = tiny_demo_config(total_steps=6, checkpoint_every=2, eval_every=6,
                                 allow_config_change=True, **{{"model.depth": 1}})
            c.mesh.fsdp, c.mesh.fsdp_min_size = fsdp, 0
            return c
        ref = loop.train_and_evaluate(cfg(1), "{tmp_path}/ref")
        first = loop.train_and_evaluate(cfg(2), "{tmp_path}/run", stop_at=4)
        assert first["step"] == 4
        out = loop.train_and_evaluate(cfg(1), "{tmp_path}/run")
        assert out["step"] == 6
        ev = evaluation.evaluate_checkpoint(cfg(2), "{tmp_path}/run")
        assert ev["step"] == 6
        assert abs(ev["metrics"]["top1"] - out["eval"]["top1"]) < 1e-6, (ev, out["eval"])
        a, _ = checkpoints.load_params("{tmp_path}/ref")
        b, _ = checkpoints.load_params("{tmp_path}/run")
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            x, y = np.asarray(x), np.asarray(y)
            scale = np.max(np.abs(x))
            if scale < 1e-3:  # a zero-gradient array (the key bias): AdamW steps on rounding noise
                assert np.max(np.abs(y)) < 1e-3
                continue
            assert np.max(np.abs(x - y)) <= 1e-4 * scale, (x, y)
        print("OK")
    """)
    _run_on_cpu_devices(script, 4, timeout=600)


def _run_on_cpu_devices(script: str, n: int, timeout: int) -> None:
    """Runs ``script`` in a fresh Python with ``n`` CPU devices (the XLA flag must be set before
    JAX starts), with XLA's backend optimizations off (tests/deploy_runs.XLA_FAST: the compiles
    are its time; what it compares is compiled alike); it must print OK."""
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={n} {XLA_FAST}",
               PYTHONPATH=REPO_ROOT)
    r = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, env=env,
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-4000:]


def test_summaries_are_the_window_means_at_their_steps_and_documented(tmp_path):
    """log_every=2 writes the mean of log_every=1's two values (loss, accuracy, grad norm), the
    learning rate the step's update used (the schedule one step back: optax's count), eval at the
    eval step, no step twice across a stop and resume; every tag is named in docs/analysis.md's
    table of what a run writes."""
    from normvit_jax import summaries
    from normvit_jax.train import optimizer
    one_block = {"model.depth": 1}  # what is written, and when, does not depend on the model
    each = tiny_demo_config(total_steps=4, log_every=1, eval_every=4, checkpoint_every=100,
                            **one_block)
    pairs = tiny_demo_config(total_steps=4, log_every=2, eval_every=4, checkpoint_every=100,
                             **one_block)
    loop.train_and_evaluate(each, str(tmp_path / "each"))
    loop.train_and_evaluate(pairs, str(tmp_path / "pairs"), stop_at=1)
    loop.train_and_evaluate(pairs, str(tmp_path / "pairs"))
    one = summaries.read_scalars(str(tmp_path / "each"))
    two = summaries.read_scalars(str(tmp_path / "pairs"))
    for tag in ("train/loss", "train/accuracy", "train/grad_norm"):
        v = {s: x for s, x, _ in one[tag]}
        assert sorted(v) == [1, 2, 3, 4] and len(set(v.values())) > 1, tag
        np.testing.assert_allclose([x for _, x, _ in two[tag]],
                                   [(v[1] + v[2]) / 2, (v[3] + v[4]) / 2], rtol=1e-6, err_msg=tag)
    sched = optimizer.schedule(each, 4)
    np.testing.assert_array_equal([(s, x) for s, x, _ in one["train/learning_rate"]],
                                  [(s, np.float32(sched(s - 1))) for s in (1, 2, 3, 4)])
    assert [s for s, _, _ in two["train/steps_per_sec"]] == [2, 4]
    assert all(x > 0 for _, x, _ in two["train/examples_per_sec"])
    assert [s for s, _, _ in two["eval/top1"]] == [4]
    doc = open(os.path.join(REPO_ROOT, "docs", "analysis.md")).read()
    table = doc[doc.index("## What a run writes"):doc.index("## During training")]
    missing = [t for t in sorted(set(one) | set(two) | {summaries.SEGMENT_TAG})
               if f"`{t}`" not in table]
    assert not missing, missing


def test_a_finished_run_rerun_says_complete_with_its_recorded_eval(finished_run, tmp_path, caplog,
                                                                   monkeypatch):
    """Re-running a finished run logged 'the data continues at step 7', 'already complete',
    then 'Compiling the train step; the first progress line follows it (0 steps to go...)' and
    no progress or closing line. Now: one line that it is complete, and the eval it recorded
    (returned, for cli.run's closing line); the train step is neither compiled nor run."""
    import logging

    from normvit_jax.train import phases
    cfg = tiny_demo_config()  # 6 steps, checkpoints at 3 and 6, eval at 6
    first, copy = finished_run
    copy(tmp_path)
    monkeypatch.setattr(phases.PhasedTrainStep, "at",
                        lambda *a: pytest.fail("the train step of a complete run was used"))
    # on absl's logger: a test before this one in the same worker may have left absl's verbosity
    # at WARNING (flags parsed in-process by the export tests)
    with caplog.at_level(logging.INFO, logger="absl"):
        again = loop.train_and_evaluate(cfg, str(tmp_path))
    lines = [r.getMessage() for r in caplog.records]
    assert again["step"] == 6
    for k in ("top1", "top5", "loss"):
        assert again["eval"][k] == pytest.approx(first["eval"][k], rel=1e-6), k
    complete = [m for m in lines if "already complete" in m]
    assert len(complete) == 1 and "(step 6 of 6)" in complete[0], lines
    assert "its eval at step 6" in complete[0], complete
    assert not [m for m in lines if "continues at step" in m or "Compiling" in m], lines


def test_steps_per_epoch_are_said_with_their_fraction():
    """361 images at batch 128 read '100 steps (2 per epoch)' while the resume line counted the
    epochs of the data stream ('epoch 7, example 10 of 361' at step 18): 2.8 per epoch."""
    from normvit_jax.train import progress
    assert progress.describe_steps(100, 361, 128) == "100 steps (2.8 per epoch, 35.5 epochs)"
    assert progress.describe_steps(880, 1000, 50) == "880 steps (20 per epoch)"
