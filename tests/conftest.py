"""Shared fixtures: tiny configs that train in seconds on one CPU core."""
from __future__ import annotations

import os

import functools
import glob
import shutil
import subprocess
import sys
import tempfile

from tests.deploy_runs import XLA_FAST

# Several pytest-xdist workers may share one GPU: each allocates on demand instead of taking 75%.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def _cpu_only() -> bool:
    """No GPU or TPU device file, and JAX not pointed at one (checked before JAX starts)."""
    return (os.environ.get("JAX_PLATFORMS", "cpu") in ("", "cpu")
            and not glob.glob("/dev/nvidia[0-9]*") and not glob.glob("/dev/accel*"))


# On a CPU-only machine, this process and every child that inherits its environment compile with
# XLA's backend optimizations off (tests/deploy_runs.XLA_FAST): the tests' tiny programs spend
# most of their time compiling, and these flags halve the suite's time. They change no result that
# a test checks: float32 tolerances against float64 references, and equality between programs that
# are all compiled the same way. A machine with an accelerator (`pytest -m gpu`, gpu_check.sh) and
# a user's own XLA_FLAGS are left as they are.
if _cpu_only() and "XLA_FLAGS" not in os.environ:
    os.environ["XLA_FLAGS"] = XLA_FAST


def compile_cache_env(folder) -> dict:
    """Environment variables that give child processes a JAX persistent compilation cache: the
    run's shared one where it is on, else ``folder`` (a module's own)."""
    return {"JAX_COMPILATION_CACHE_DIR": os.environ.get("JAX_COMPILATION_CACHE_DIR", str(folder)),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def _shared_compile_cache() -> None:
    """One JAX persistent compilation cache for the whole test run on a CPU-only machine: the
    workers and every child process they start inherit it with the environment, and load a
    program that another one compiled (the tiny configs' train and eval steps recur across files,
    and a resumed run compiles its first run's programs again): 5-13% less time on 2 cores. A loaded
    executable is the one compiled, so no result changes. The process that made the folder (the
    xdist controller, whose pytest_configure runs before it starts the workers) removes it at the
    end. Made in pytest_configure, not on import: scripts run outside pytest (tests/fault_config.py
    through main.py, tests/fsdp_script.py) import this file too."""
    if not _cpu_only() or "JAX_COMPILATION_CACHE_DIR" in os.environ:
        return
    os.environ.update(compile_cache_env(tempfile.mkdtemp(prefix="normvit_jax_tests_cache_")),
                      NORMVIT_JAX_TESTS_CACHE_OWNER=str(os.getpid()))


def environ_without_xla_flags() -> dict:
    """This process's environment as a user's shell has it: without the XLA_FLAGS set above."""
    return {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}


def with_default_xla_flags(test):
    """For a test whose claim holds for the programs XLA compiles by default, not for any
    compilation (two different programs that must give bit-identical results): under XLA_FAST it
    runs in a child pytest with XLA's default flags, and passes or fails with it."""
    @functools.wraps(test)
    def run(*args, **kwargs):
        if os.environ.get("XLA_FLAGS") != XLA_FAST:
            return test(*args, **kwargs)
        node = os.environ["PYTEST_CURRENT_TEST"].rsplit(" (", 1)[0]
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                            node], cwd=REPO_ROOT, env={**os.environ, "XLA_FLAGS": ""},
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return run

import jax  # noqa: E402
import pytest  # noqa: E402

from configs import vit_ln  # noqa: E402


def ctrl_c_mid_write(monkeypatch) -> None:
    """Every file opened for writing gets a few bytes, then Ctrl-C (tests of atomic writes)."""
    real_open = open

    def failing_open(path, mode="r", *a, **k):
        f = real_open(path, mode, *a, **k)
        if "w" in mode:
            f.write("half")
            raise KeyboardInterrupt
        return f
    monkeypatch.setattr("builtins.open", failing_open)


def tiny_demo_config(**overrides):
    """The digits demo shrunk to a 2-block, 32-wide ViT; a few steps take seconds."""
    c = vit_ln.get_config("demo")
    c.model.hidden_size = 32
    c.model.depth = 2
    c.model.num_heads = 2
    c.model.mlp_dim = 64
    c.batch_size = 32
    c.eval_batch_size = 64
    c.total_steps = 6
    c.log_every = 2
    c.eval_every = 6
    c.checkpoint_every = 3
    c.schedule.warmup_steps = 2
    c.eval_analysis_images = 0  # one more compile per run; tests/test_analysis.py turns it on
    for k, v in overrides.items():
        node = c
        *path, last = k.split(".")
        for p in path:
            node = node[p]
        node[last] = v
    return c


@pytest.fixture
def tiny_config():
    return tiny_demo_config()


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
    """JAX's persistent compilation cache for one test module (``pytestmark =
    pytest.mark.usefixtures("compile_cache")``): a program compiled again in the same module (a
    straight run, then stop + resume, or the same tiny config in several tests) is loaded, not
    compiled; its executable is the one compiled the first time. Off again after the module.
    Nothing to do where the run's shared cache is on (a CPU-only machine: _shared_compile_cache)."""
    if os.environ.get("NORMVIT_JAX_TESTS_CACHE_OWNER"):
        yield  # the run's shared cache is on already
        return
    from jax.experimental.compilation_cache import compilation_cache as cc
    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")
    old = {n: jax.config.values[n] for n in names}
    jax.config.update("jax_compilation_cache_dir", str(tmp_path_factory.mktemp("jax_cache")))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    cc.reset_cache()
    try:
        yield
    finally:
        for n, v in old.items():
            jax.config.update(n, v)
        cc.reset_cache()


# `pytest -m gpu`: tests/test_gpu.py (marked there) and these, which check what a GPU computes
# differently (cuDNN/TF32/bfloat16 paths, DTN's products and its Triton kernels at 197 tokens, the
# padded attention, the train step's donation and single compile). Node ids are matched as
# prefixes; about 2 minutes on one CPU.
GPU_SELECTION = (
    "tests/test_padded_attention.py::",
    "tests/test_norms_dtn.py::",
    "tests/test_norms_dtn_pallas.py::test_dtn_pallas_kernel_in_bfloat16_against_float64_and_xla",
    "tests/test_model.py::test_attention_impls_compute_the_same_function",
    "tests/test_model.py::test_patch_embedding_equals_convolution",
    "tests/test_model.py::test_attention_capture_rows_sum_to_one_and_match_fused_path",
    "tests/test_train_step.py::test_compiles_once_no_host_transfer_donated[layernorm]",
    "tests/test_train_step.py::test_grad_accumulation_equals_the_large_batch",
    "tests/test_scan.py::test_train_steps_match_and_state_converts_both_ways",
)


# The files that take longest (summed test times, 2 cores, 2026-11-28: 1600 s in all), longest
# first. xdist (--dist loadfile) hands whole files to the workers in collection order: these go
# first, so the run does not end with one worker alone on a long file while the other idles.
SLOW_FILES = (
    "test_benchmarks.py", "test_benchmarks_gpu_table.py", "test_norms_dtn_pallas.py",
    "test_multiprocess.py", "test_export_formats.py", "test_fsdp.py", "test_tools_restore.py",
    "test_interruptions.py", "test_presets.py", "test_demo_numbers.py", "test_own_data.py",
    "test_train.py", "test_faults.py", "test_reparam.py", "test_scan.py", "test_recipe.py",
    "test_optimizer.py", "test_norms_configs.py", "test_serve.py", "test_mixing.py",
    "test_ema_weights.py", "test_first_hour.py", "test_reparam_dynamic.py", "test_train_step.py",
    "test_t2t_vit.py", "test_norms_dtn.py")


def pytest_collection_modifyitems(config, items):
    """Marks GPU_SELECTION's tests 'gpu' (node ids relative to the repository or to tests/), and
    runs SLOW_FILES first (in that order; the rest keep theirs)."""
    strip = lambda s: s.replace(os.sep, "/").removeprefix("tests/")
    for item in items:
        if any(strip(item.nodeid).startswith(strip(s)) for s in GPU_SELECTION):
            item.add_marker(pytest.mark.gpu)
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(os.path.basename(str(item.path)), len(rank)))


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def float32_matmuls():
    """Full float32 matrix products for tests that compare float32 numerics at ~1e-5: on GPU
    (Ampere and later) XLA's default precision runs float32 dots in TF32 (10-bit mantissa, errors
    ~1e-3), which such tolerances are not meant to absorb. On CPU the default is float32 already,
    so this changes nothing there; the tolerances stay what they are."""
    with jax.default_matmul_precision("float32"):
        yield


@pytest.fixture(scope="session", autouse=True)
def _jax_backend_started():
    """JAX's backend started before the first test, in every process that runs tests: a
    ``train_and_evaluate`` of a demo config (reproducible_cpu_threads=2) would otherwise pin
    XLA:CPU's numerics for the rest of the process when it came first (changing XLA_FLAGS, which
    with_default_xla_flags and child processes read); started, it says in one warning line that it
    trains unpinned, as these tests always have (tests/test_library_use.py)."""
    jax.devices()
    yield


def detach_run_logs() -> list:
    """Removes (and closes) what ``run_log`` attaches to the absl logger, a run's training.log
    handler and ``_attach``'s filter, where a RunLog was not ended; returns what it removed."""
    from absl import logging as absl_logging
    from normvit_jax import run_log
    absl_logger = absl_logging.get_absl_logger()
    left = [h for h in absl_logger.handlers if isinstance(h, run_log._LogFileHandler)] + \
        [f for f in absl_logger.filters if isinstance(f, run_log._OnlyToFile)]
    for item in left:
        if isinstance(item, run_log._OnlyToFile):
            absl_logger.removeFilter(item)
        else:
            absl_logger.removeHandler(item)
            item.close()
    return left


@pytest.fixture(autouse=True)
def _no_run_log_left_on_the_absl_logger():
    """A test that leaves a run's training.log handler, or ``run_log._attach``'s filter, on the
    absl logger changes what every later test in its worker logs and captures (a stale filter
    keeps INFO lines from caplog): it fails here, and the logger is cleaned for the next test."""
    yield
    left = detach_run_logs()
    if left:
        from absl import logging as absl_logging
        absl_logging.get_absl_logger().setLevel(0)  # NOTSET: _attach's level goes with its filter
        pytest.fail(f"the test left {left} on the absl logger (a RunLog not ended)")


def pytest_configure(config):
    """The run's shared compilation cache (_shared_compile_cache), in this process's JAX too (JAX
    read its environment when this file imported it)."""
    _shared_compile_cache()
    if os.environ.get("NORMVIT_JAX_TESTS_CACHE_OWNER"):
        jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_unconfigure(config):
    """The process that made the run's compilation cache removes it (not a worker, not a child
    pytest that inherited it)."""
    if os.environ.get("NORMVIT_JAX_TESTS_CACHE_OWNER") == str(os.getpid()):
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
