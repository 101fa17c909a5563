"""Smoke tests of every benchmark entry point on a tiny model: they run and report what they
promise. No timing assertions (timings belong in docs/benchmarks.md). benchmarks.gpu_table and
its --quick parts: tests/test_benchmarks_gpu_table.py.

The child processes of --isolate and of vs_torch compile with XLA's backend optimizations off
(tests/deploy_runs.XLA_FAST in their XLA_FLAGS): these tests check what the tools report, not
what XLA's optimizations make of a step, and the compiles are most of their time."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT, ctrl_c_mid_write
from tests.deploy_runs import XLA_FAST

TINY = ["--model=Ti/4", "--depth=1", "--image_size=8"]


def refused(main, argv: list[str], capsys) -> str:
    """The CLI contract (docs/faults.md): ``main(argv)`` stops with one stderr line naming the
    problem and exit 2, no traceback; returns that line."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err, (e.value, err)
    return err


def test_a_norm_added_to_the_registry_is_a_benchmark_norm(monkeypatch):
    """benchmarks.common.NORMS was a hand list: a new norm was refused by --norm (and left out
    of 'all') until an entry was added there; now every registry name is in it."""
    import importlib

    from benchmarks import common
    from normvit_jax.norms import registry
    monkeypatch.setitem(registry._ENTRIES, "user_norm", "normvit_jax.norms.rmsnorm:RMSNorm")
    try:
        importlib.reload(common)
        assert common.norm_names("user_norm") == ["user_norm"]  # was SystemExit: unknown
        assert "user_norm" in common.REGISTRY_ONLY
        assert "user_norm" in common.norm_names("all")
        assert common.bench_config("Ti/4", "user_norm").model.norm.name == "user_norm"
    finally:
        monkeypatch.undo()
        importlib.reload(common)
    assert "user_norm" not in common.NORMS


def test_train_step_all_norms_side_by_side():
    from benchmarks import train_step
    res = train_step.main(TINY + ["--norm=layernorm,dtn,powernorm", "--batch=4", "--steps=1",
                                  "--warmup=1", "--peak_tflops=1"])
    rows = {r["norm"]: r for r in res["rows"]}
    assert set(rows) == {"layernorm", "dtn", "powernorm"}
    assert rows["layernorm"]["flop_ratio"] == 1.0 and rows["dtn"]["flop_ratio"] > 1.0
    for r in rows.values():
        assert r["model_gflops"] > 0 and r["compile_s"] > 0 and r["step_median_s"] > 0
        assert r["mfu"] > 0 and r["xla_peak_gib"] > 0 and r["within"] in ("yes", "NO")
        # On CPU XLA's count includes the analytic matmuls plus elementwise work and the optimizer.
        assert r["xla_gflops"] >= 0.9 * (r["model_gflops"] + r["norm_gflops"])
    assert rows["dtn"]["norm_gflops"] > 0 and rows["layernorm"]["norm_gflops"] == 0
    assert rows["dtn"]["flop_source"] in ("xla", "analytic")  # tiny: elementwise work dominates


def test_norm_kernels_times_dtn_pallas_tilings(capsys):
    """norm_kernels: DTN's Pallas kernels (Pallas's interpreter here) beside LayerNorm, and each
    --dtn_tilings value as a row of its own; a bad tiling exits 2 in one line naming it."""
    from benchmarks import norm_kernels
    res = norm_kernels.main(["--model=Ti/8", "--norm=layernorm,dtn_pallas", "--batch=2",
                             "--steps=1", "--warmup=0", "--dtn_tilings=16/16/4:16/16/4"])
    rows = {(r["mode"], r["norm"]) for r in res["rows"]}
    assert rows == {(m, n) for m in ("train", "eval")
                    for n in ("layernorm", "dtn_pallas", "dtn_pallas@16/16/4:16/16/4")}
    # exit 2, one stderr line, no traceback (refused); in this process: a child only added the
    # start of Python and JAX to the same check
    assert "pallas_tiling='32/64/3'" in refused(norm_kernels.main, ["--dtn_tilings=32/64/3"], capsys)


def test_norm_kernels_keeps_the_other_rows_when_a_layer_fails(monkeypatch, capsys):
    """A layer that fails to build or compile (DTN's Triton kernels on a GPU they never ran on)
    costs its own rows only: they say 'failed: <the error's first line>', one stderr line names
    it, the other norms are timed; LayerNorm, the reference of every ratio, failing stops it."""
    from benchmarks import norm_kernels
    real = norm_kernels.make_runner

    def make_runner(name, *args):
        if name == "dtn_pallas":
            raise RuntimeError("Triton compilation failed\nsecond line")
        return real(name, *args)

    monkeypatch.setattr(norm_kernels, "make_runner", make_runner)
    res = norm_kernels.main(["--model=Ti/8", "--norm=layernorm,dtn_pallas,repbn", "--batch=2",
                             "--steps=1", "--warmup=0"])
    rows = {(r["mode"], r["norm"]): r for r in res["rows"]}
    assert len(rows) == 6 and res["failed"] == {
        "dtn_pallas": "failed: RuntimeError: Triton compilation failed"}
    for mode in ("train", "eval"):
        assert rows[(mode, "dtn_pallas")]["ms"] == res["failed"]["dtn_pallas"]
        assert rows[(mode, "dtn_pallas")]["ratio_to_ln"] == "-"
        assert rows[(mode, "repbn")]["ms"][0].isdigit() and rows[(mode, "repbn")]["ratio_to_ln"] != "-"
    assert "norm_kernels: dtn_pallas: failed: RuntimeError" in capsys.readouterr().err
    monkeypatch.setattr(norm_kernels, "make_runner", lambda *a: (_ for _ in ()).throw(OSError("x")))
    with pytest.raises(OSError):
        norm_kernels.main(["--model=Ti/8", "--norm=layernorm", "--batch=2", "--steps=1",
                           "--warmup=0"])


def test_train_step_single_norm_with_options():
    from benchmarks import train_step
    res = train_step.main(TINY + ["--norm=unified", "--batch=4", "--steps=1", "--warmup=0",
                                  "--scan", "--remat", "--grad_accum=2"])
    assert res["peak_source"] == "probe" and res["peak_flops"] > 0
    assert "time_ratio" not in res["rows"][0]
    # the header names the overridden depth: else the table reads as the whole Ti/4's
    assert train_step.report(res).startswith("train step: model=Ti/4 depth=1 image=8 ")


def test_train_step_times_the_on_device_augmentation(capsys):
    from benchmarks import train_step
    res = train_step.main(TINY + ["--augment=none,deit", "--batch=4", "--steps=1", "--warmup=0",
                                  "--peak_tflops=1"])
    rows = {r["norm"]: r for r in res["rows"]}
    assert set(rows) == {"layernorm", "layernorm+deit"}
    assert rows["layernorm+deit"]["time_ratio_median"] > 0 and rows["layernorm+deit"]["within"] == "-"
    assert "--augment: unknown" in refused(train_step.main, TINY + ["--augment=autoaugment"], capsys)


def test_train_step_isolated_norms_each_in_a_process(tmp_path, monkeypatch):
    from benchmarks import train_step
    monkeypatch.setenv("XLA_FLAGS", XLA_FAST)  # the children's (this process started JAX already)
    res = train_step.main(TINY + ["--norm=layernorm,rmsnorm", "--isolate", "--batch=4", "--steps=1",
                                  "--warmup=0", "--peak_tflops=1", f"--isolate_dir={tmp_path}",
                                  "--json=" + str(tmp_path / "all.json")])
    rows = {r["norm"]: r for r in res["rows"]}
    assert set(rows) == {"layernorm", "rmsnorm"} and res["failures"] == []
    assert rows["layernorm"]["time_ratio_median"] == 1.0 and rows["rmsnorm"]["time_ratio_median"] > 0
    assert res["machine"]["backend"] == "cpu"  # from the children: the parent started no backend
    assert (tmp_path / "rmsnorm.log").exists() and (tmp_path / "all.json").exists()


def test_isolate_reports_failures_and_timeouts_and_goes_on(tmp_path):
    from benchmarks import isolate
    scripts = {"ok": "import json,sys; json.dump({'v': 1}, open(sys.argv[1], 'w'))",
               "fails": "raise SystemExit('boom')",
               "hangs": "import time; time.sleep(30)"}
    outs = [isolate.run_one(n, [sys.executable, "-c", code, str(tmp_path / f"{n}.json")],
                            str(tmp_path / f"{n}.json"), str(tmp_path / f"{n}.log"), timeout_s=3)
            for n, code in scripts.items()]
    assert [o.status for o in outs] == ["ok", "failed", "timeout"]
    assert outs[0].result == {"v": 1}
    assert "exit code 1" in outs[1].reason and "boom" in outs[1].reason
    assert "timed out" in outs[2].reason and outs[2].seconds < 10


def test_inference():
    from benchmarks import inference
    res = inference.main(TINY + ["--norm=layernorm,batchnorm", "--batch=4", "--steps=1",
                                 "--warmup=0", "--fold"])
    rows = {r["norm"]: r for r in res["rows"]}
    assert list(rows) == ["layernorm", "batchnorm", "batchnorm+folded"]
    assert all(r["images_per_s"] > 0 for r in res["rows"])
    # Folding removes the norms' FLOPs (XLA's count of the compiled eval).
    assert 0 < rows["batchnorm+folded"]["flops_per_batch"] < rows["batchnorm"]["flops_per_batch"]
    assert inference.report(res).startswith("inference (train=False): model=Ti/4 depth=1 image=8 ")


def test_input_pipeline_digits():
    from benchmarks import input_pipeline
    res = input_pipeline.main(["--datasets=digits", "--batches=2", "--steps=1", "--batch=16",
                               "--depth=1"])
    (row,) = res["rows"]
    assert row["source"] == "bundled" and row["pipeline_ex_s"] > 0 and row["step_ex_s"] > 0
    assert 0 <= row["wait_fraction"] <= 1


def test_input_pipeline_core_scaling(capsys):
    """--cores: the ImageNet pipeline alone in a child pinned to N cores (synthetic JPEGs). A
    count above the host's cores is left out and named (the README's --cores=1,2,4,8,16 was
    refused whole on any host with fewer than 16 cores); none left is refused."""
    from benchmarks import input_pipeline
    res = input_pipeline.main(["--cores=1,4096", "--batches=1", "--batch=8",
                               "--synthetic_examples=16"])
    (row,) = res["rows"]
    assert (row["cores"], row["workers"], row["source"]) == (1, 1, "synthetic JPEG")
    assert row["images_s"] > 0 and row["images_s_per_core"] == row["images_s"]
    assert row["efficiency"] == 1.0
    assert "--cores: [4096] left out: this process may use " in capsys.readouterr().err
    assert "\nnot measured: [4096] cores" in input_pipeline.report(res)
    assert "--cores=4096: each count must be in [1, " in refused(input_pipeline.main,
                                                                 ["--cores=4096"], capsys)


def test_memory_fit():
    from benchmarks import memory
    res = memory.main(["--models=Ti/4", "--image_size=8", "--depth=1", "--probe_batches=8,64",
                       "--memory_gb=1", "--num_classes=10"])
    rows = {r["remat"]: r for r in res["rows"]}
    assert rows[False]["per_sample_MiB"] > 0 and rows[False]["max_batch@1GiB"] > 0
    # Activations, not just the input image (8*8*3 float32): XLA:CPU's own peak counted only that.
    assert rows[False]["per_sample_MiB"] * 2 ** 20 > 4 * 8 * 8 * 3 * 4
    assert rows[True]["per_sample_MiB"] <= rows[False]["per_sample_MiB"] * 1.05
    assert "image=8, depth=1, scan=False;" in memory.report(res)


def test_compile_time():
    from benchmarks import compile_time
    res = compile_time.main(["--model=Ti/4", "--image_size=8", "--batch=2", "--depths=1,2"])
    assert {(r["layout"], r["depth"]) for r in res["rows"]} == {
        ("unrolled", 1), ("unrolled", 2), ("scan", 1), ("scan", 2)}


def test_matmul_shapes():
    from benchmarks import matmul
    res = matmul.main(TINY + ["--batch=2", "--repeats=1", "--no_torch"])
    assert len(res["rows"]) == 14 and res["per_step_s"]["xla"] > 0


def _vs_torch_subprocess(args: list[str], tmp_path) -> dict:
    """benchmarks.vs_torch as its own process, as it is run: an xdist worker may have imported
    TensorFlow already, after which torchvision's import segfaults (TensorFlow 2.21)."""
    j = tmp_path / "vt.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.vs_torch", *args, f"--json={j}"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "XLA_FLAGS": XLA_FAST})
    assert proc.returncode == 0, proc.stderr[-3000:]
    # progress while it compiles and builds timm (it printed nothing until the end)
    for m in [a.split("=")[1] for a in args if a.startswith("--model=")][0].split(","):
        assert f"{m}: compiled jax in " in proc.stderr and f"{m}: timm eager on " in proc.stderr
    return {**json.loads(j.read_text()), "stdout": proc.stdout}


@pytest.mark.skipif(importlib.util.find_spec("torch") is None
                    or importlib.util.find_spec("timm") is None,
                    reason="torch/timm not installed (optional extra)")
def test_vs_torch(tmp_path):
    res = _vs_torch_subprocess(TINY + ["--batch=4", "--steps=1", "--warmup=1"], tmp_path)
    params = {r["impl"]: r["params"] for r in res["rows"]}
    assert params["jax"] == params["timm"]  # the same model on both sides
    assert "vs timm: model=Ti/4 depth=1 image=8 batch=4 " in res["stdout"]
    assert res["speed_vs_timm"]["median"] > 0


@pytest.mark.skipif(importlib.util.find_spec("torch") is None
                    or importlib.util.find_spec("timm") is None,
                    reason="torch/timm not installed (optional extra)")
def test_vs_torch_two_models_in_one_process(tmp_path):
    res = _vs_torch_subprocess(["--model=Ti/8,Ti/4", "--image_size=16", "--depth=1", "--batch=4",
                                "--steps=1", "--warmup=1"], tmp_path)
    assert [r["args"]["model"] for r in res["models"]] == ["Ti/8", "Ti/4"] and not res["skipped"]
    for r in res["models"]:
        assert {row["impl"] for row in r["rows"]} >= {"jax", "timm"}
        assert r["speed_vs_timm"]["median"] > 0


def test_vs_torch_without_torch_fails_clearly(monkeypatch):
    from benchmarks import vs_torch
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ImportError
    monkeypatch.delitem(sys.modules, "tensorflow", raising=False)  # as in its own process
    with pytest.raises(SystemExit, match=r"pip install -e '\.\[torch\]'"):
        vs_torch.import_torch_timm()


def test_vs_torch_after_tensorflow_says_why_instead_of_crashing(monkeypatch):
    import types

    from benchmarks import vs_torch
    monkeypatch.setitem(sys.modules, "tensorflow", types.ModuleType("tensorflow"))
    with pytest.raises(SystemExit, match="in its own process"):
        vs_torch.import_torch_timm()


def test_torch_plan_runs_timm_where_jax_runs():
    """Without torch: the plan for a CUDA host and for a CPU host."""
    from benchmarks import vs_torch
    gpu = vs_torch.torch_plan(True, "bfloat16")
    assert (gpu.device, gpu.variants, gpu.autocast) == ("cuda", ("eager", "compiled"), "bfloat16")
    assert gpu.fused_adamw and gpu.tf32 and not gpu.jax_preallocate
    cpu = vs_torch.torch_plan(False, "float32")
    assert (cpu.device, cpu.variants, cpu.autocast) == ("cpu", ("eager",), None)
    assert not cpu.fused_adamw and cpu.jax_preallocate
    assert vs_torch.torch_plan(True, "float32", compile_="no").variants == ("eager",)
    assert vs_torch.torch_plan(True, "float32", device="cpu").device == "cpu"
    with pytest.raises(SystemExit, match="no CUDA"):
        vs_torch.torch_plan(False, "float32", device="cuda")


def test_xla_flags_are_set_before_jax_starts():
    code = ("import os, sys; from benchmarks import xla_flags; r = xla_flags.apply(); "
            "assert 'jax' not in sys.modules; print(os.environ['XLA_FLAGS'])")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                         text=True, env={**os.environ, "XLA_FLAGS": ""}, check=True).stdout
    from benchmarks import xla_flags
    for k, v in xla_flags.PRESETS["tuned"].items():
        assert f"--{k}={v}" in out


def test_prepare_rate_times_a_jpeg_folder():
    from benchmarks import prepare_rate
    res = prepare_rate.main(["--images=12", "--workers=1", "--train_input", "--batches=1",
                             "--repeats=1"])
    row, *train_input = res["rows"]
    assert row["images"] == 12 and row["images_s"] > 0
    assert [r["source"].split(", ")[1].split(" ")[0] for r in train_input] == ["prepared",
                                                                                "imagenet2012"]
    assert all(r["images"] == 12 and r["images_s"] > 0 for r in train_input)


def test_xla_presets_are_cpu_only(monkeypatch):
    """With a GPU plugin installed the CPU presets set nothing (a kept optimization barrier does
    not compile there); JAX_PLATFORMS=cpu brings them back."""
    import importlib.util
    from benchmarks import xla_flags
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a: object() if n == "jax_cuda13_plugin" else real(n, *a))
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    assert xla_flags.accelerator_expected()
    assert xla_flags.apply("tuned", [])["flags"] == {} and xla_flags.compiler_options() == {}
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert not xla_flags.accelerator_expected()
    assert xla_flags.apply("tuned", [])["flags"] == xla_flags.PRESETS["tuned"]


def test_train_step_one_process_with_xla_flag_variants(tmp_path, capsys):
    from benchmarks import train_step
    j = tmp_path / "one.json"
    res = train_step.main(TINY + ["--one_process", "--batch=4", "--steps=1", "--warmup=0",
                                  "--peak_tflops=1", f"--json={j}", "--ln_variants="
                                  "base=;fm=--xla_cpu_enable_fast_math=true;bad=--xla_bogus=1"])
    rows = {r["norm"]: r for r in res["rows"]}
    assert list(rows) == ["layernorm", "layernorm@fm"]
    assert rows["layernorm"]["time_ratio_median"] == 1.0
    assert rows["layernorm@fm"]["time_ratio_median"] > 0 and rows["layernorm@fm"]["within"] == "-"
    (bad,) = res["failures"]
    assert bad["norm"] == "layernorm@bad" and "xla_bogus" in bad["reason"]
    assert json.loads(j.read_text())["pending"] == []
    assert "need --one_process" in refused(train_step.main, TINY + ["--ln_variants=a=--xla_x=1"],
                                           capsys)
    err = refused(train_step.main, TINY + ["--one_process", "--ln_variants=a b"], capsys)
    assert err.startswith("python -m benchmarks.train_step: error: --ln_variants: 'a b' is not "), err


def test_train_step_one_process_interleaved_rounds(tmp_path, capsys):
    """--interleave_rounds: every norm's step kept, then timed round-robin; each row gets its
    per-round ratio to LayerNorm's (LN's own exactly 1), and a budget too small for the rounds
    says why instead."""
    from benchmarks import train_step
    args = TINY + ["--one_process", "--batch=4", "--steps=2", "--warmup=0", "--peak_tflops=1",
                   "--norm=layernorm,dyt", "--interleave_rounds=3"]
    res = train_step.main(args + [f"--json={tmp_path / 'i.json'}"])
    rows = {r["norm"]: r for r in res["rows"]}
    assert rows["layernorm"]["interleaved_ratio_median"] == 1.0
    assert 0 < rows["dyt"]["interleaved_ratio_median"] < 100
    median = rows["dyt"]["interleaved_ratio_median"]
    assert rows["dyt"]["interleaved_ratio"].startswith(f"{median:.3f} [")
    assert "interleaved_skipped" not in res
    saved = json.loads((tmp_path / "i.json").read_text())
    assert saved["rows"][1]["interleaved_ratio_median"] == rows["dyt"]["interleaved_ratio_median"]
    res = train_step.main(args + ["--interleave_rounds=100000", "--time_budget_s=60"])
    assert "interleaved_ratio" not in res["rows"][1] and "needed" in res["interleaved_skipped"]
    assert "need --one_process" in refused(train_step.main, TINY + ["--interleave_rounds=2"], capsys)
    assert "--interleave_rounds=-1: must be >= 0" in refused(
        train_step.main, TINY + ["--one_process", "--interleave_rounds=-1"], capsys)


def test_xla_flag_variants_parse():
    from benchmarks import xla_flags
    assert xla_flags.parse_variants("base=; lhs=--xla_a=true --xla_b=4") == [
        ("base", ""), ("lhs", "--xla_a=true --xla_b=4")]
    assert xla_flags.flag_options("--xla_a=true --xla_b=4 --xla_c=False") == {
        "xla_a": True, "xla_b": "4", "xla_c": False}
    for bad in ("lhs", "a b=--x=1", "a=--x=1;a=--y=2", "a=xla_x=1"):
        with pytest.raises(SystemExit):
            xla_flags.parse_variants(bad)


def test_prepared_in_memory_times_the_three_pipelines(tmp_path):
    from benchmarks import prepared_in_memory
    # the demo config shrunk to one 16-wide block (--config takes any config file): the test
    # checks the three pipelines feed the step and are reported, not the demo model's speed
    cfg = tmp_path / "tiny_demo.py"
    cfg.write_text("from configs import vit_ln\n\n\ndef get_config(arg=None):\n"
                   "    c = vit_ln.get_config('demo')\n"
                   "    c.model.update(hidden_size=16, depth=1, num_heads=2, mlp_dim=32)\n"
                   "    return c\n")
    res = prepared_in_memory.main([f"--config={cfg}", "--images=40",
                                   "--batch=8", "--rounds=1", "--block=3", "--skip=1"])
    rows = {r["pipeline"]: r for r in res["rows"]}
    assert set(rows) == {"arrays", "prepared", "decoding"} and rows["arrays"]["vs_arrays"] == 1
    assert all(r["steps_s"] > 0 for r in rows.values())


def test_deploy_benchmark_times_unfolded_and_folded_artifacts(tmp_path):
    """benchmarks.deploy on the demo model (LN, RepBN; ONNX Runtime and the StableHLO artifact,
    batch 1): a row per norm, runtime and kind, RepBN folded, the table written between markers."""
    from benchmarks import deploy
    md = tmp_path / "b.md"
    md.write_text(f"before\n{deploy.BEGIN}\nSTALE TABLE\n{deploy.END}\nafter\n")
    rows = deploy.main(["--models=demo", "--norms=layernorm,repbn", "--runtimes=onnx,stablehlo",
                        "--batches=1", "--reps=1", "--anchors=no", f"--md={md}"])
    kinds = {(r["norm"], r["runtime"], r["kind"]) for r in rows}
    assert kinds == {(n, rt, k) for rt in ("onnx", "stablehlo")
                     for n, k in [("layernorm", "unfolded"), ("repbn", "unfolded"),
                                  ("repbn", "folded")]}
    assert all(r["median_ms"] > 0 and r["images_per_s"] > 0 for r in rows)
    assert {r["folded_slots"] for r in rows if r["kind"] == "folded"} == {9}  # 4 blocks x 2 + final
    text = md.read_text()
    assert "STALE TABLE" not in text and text.startswith("before") and text.endswith("after\n")
    assert "| RepBN | ONNX Runtime CPU |" in text


def test_deploy_benchmark_runs_where_only_jax_is(tmp_path):
    """The GPU hosts have no TensorFlow and no ONNX Runtime: `--runtimes=stablehlo` must run with
    neither importable (the JAX rows of issue 34's GPU table), label the runtime by the device JAX
    runs on, and name only the runtimes it used; the CPU table's block stays for CPU runs."""
    md = tmp_path / "b.md"
    md.write_text("intro\n")
    code = ("import sys\n"
            "for m in ('tensorflow', 'onnxruntime', 'onnx', 'jax2onnx'): sys.modules[m] = None\n"
            "from benchmarks import deploy\n"
            "rows = deploy.main(['--models=demo', '--norms=repbn', '--runtimes=stablehlo',\n"
            f"    '--batches=1', '--reps=1', '--anchors=no', '--md={md}'])\n"
            "assert {(r['runtime'], r['kind']) for r in rows} == "
            "{('stablehlo', 'unfolded'), ('stablehlo', 'folded')}, rows\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True,
                       timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 0, r.stderr[-2000:]
    text = md.read_text()
    assert "| RepBN | JAX jit CPU |" in text and "onnxruntime" not in text
    assert "<!-- deploy-table:begin -->" in text and "deploy-table-gpu" not in text


@pytest.mark.parametrize("module, argv, message", [
    ("train_step", ["--norm=bogus"], "--norm: unknown ['bogus']"),  # was exit 1
    ("train_step", ["--model=Ti", "--depth=1"], "model 'Ti' is not a known preset"),  # IndexError
    ("inference", ["--model=X/4", "--norm=layernorm"], "'X/4' is not a known preset"),  # traceback
    ("norm_kernels", ["--norm=bogus"], "--norm: unknown ['bogus']"),
    ("fold_ops", ["--model=X/16"], "'X/16' is not a known preset"),
    ("deploy", ["--models=X/3", "--norms=layernorm", "--runtimes=stablehlo"], "'X/3'"),
])
def test_a_bad_model_or_norm_is_one_line_and_exit_2(module, argv, message, capsys):
    """Each was a traceback (a ValueError, IndexError) or a bare message with exit 1, the code of
    a bug; the project's tools answer bad input with '<prog>: error: ...' and exit 2."""
    main = importlib.import_module(f"benchmarks.{module}").main
    err = refused(main, argv, capsys)
    assert err.startswith(f"python -m benchmarks.{module}: error: ") and message in err, err


@pytest.mark.parametrize("module, flag", [
    ("train_step", "--steps=0"),      # was exit 0 with a table of NaN
    ("train_step", "--warmup=-1"),    # was one timed round fewer than --steps, silently
    ("inference", "--batch=0"),       # was a ZeroDivisionError
    ("norm_kernels", "--steps=0"),
    ("vs_torch", "--steps=0"),
    ("deploy", "--reps=0"),
    ("input_pipeline", "--batches=0"),
    ("compile_time", "--repeats=0"),
])
def test_counts_out_of_range_are_one_line_and_exit_2(module, flag, capsys):
    main = importlib.import_module(f"benchmarks.{module}").main
    name, value = flag[2:].split("=")
    err = refused(main, [flag], capsys)
    assert f"argument --{name}: {value} is not accepted; accepted: an integer >= " in err, err


@pytest.mark.parametrize("module, argv, message", [
    ("train_step", ["--json=/proc/no/r.json"], "--json=/proc/no/r.json: cannot write in /proc"),
    ("deploy", ["--json=/proc/no/r.json"], "--json=/proc/no/r.json: cannot write in /proc"),
    ("deploy", ["--md=/proc/no/b.md"], "--md=/proc/no/b.md: cannot write in /proc"),
    ("deploy", ["--include=/nonexistent/rows.json"], "--include=/nonexistent/rows.json: cannot"),
    ("deploy", ["--norms=bogus"], "--norms: unknown ['bogus']"),        # was a KeyError
    ("deploy", ["--runtimes=tflite"], "--runtimes: unknown ['tflite']"),  # was a KeyError
    ("deploy", ["--batches=1,x"], "--batches=1,x: accepted: a comma list of integers >= 1"),
    ("deploy", ["--models=S16"], "model 'S16' is not a known preset"),
])
def test_outputs_and_list_flags_are_checked_before_the_work(module, argv, message, capsys):
    """An unwritable --json was a traceback after the whole measurement; deploy's unknown names
    were tracebacks after the first exports."""
    err = refused(importlib.import_module(f"benchmarks.{module}").main,
                  argv + ["--model=Ti/4" if module == "train_step" else "--anchors=no"], capsys)
    assert message in err, err


def test_deploy_writes_its_markdown_atomically(tmp_path, monkeypatch):
    """--md rewrites a doc (docs/benchmarks.md): a write cut short must leave the old file."""
    from benchmarks import deploy
    md = tmp_path / "b.md"
    md.write_text(f"intro\n{deploy.BEGIN}\nold\n{deploy.END}\ntail\n")
    real_open = open

    def failing_open(path, mode="r", *a, **k):
        f = real_open(path, mode, *a, **k)
        if "w" in mode:
            f.write("half")
            raise KeyboardInterrupt  # Ctrl-C mid-write
        return f
    monkeypatch.setattr("builtins.open", failing_open)
    with pytest.raises(KeyboardInterrupt):
        deploy.write_md(str(md), "new")
    monkeypatch.undo()
    assert md.read_text() == f"intro\n{deploy.BEGIN}\nold\n{deploy.END}\ntail\n"
    deploy.write_md(str(md), "new")
    assert md.read_text() == f"intro\n{deploy.BEGIN}\nnew\n{deploy.END}\ntail\n"
    assert os.listdir(tmp_path) == ["b.md"]


@pytest.mark.parametrize("module, flag, message", [
    ("memory", "--norm=bogus", "--norm: unknown 'bogus'"),                  # was a KeyError
    ("memory", "--probe_batches=4", "--probe_batches=4: accepted: two"),   # was an unpack error
    ("memory", "--probe_batches=4,4", "--probe_batches=4,4: accepted: two"),  # ZeroDivisionError
    ("memory", "--memory_gb=abc", "--memory_gb=abc: accepted: a comma list of GiB > 0"),
    ("input_pipeline", "--cores=a,b", "--cores=a,b: each count must be in [1, "),  # ValueError
])
def test_memory_and_input_pipeline_list_flags_are_one_line_and_exit_2(module, flag, message,
                                                                       capsys):
    err = refused(importlib.import_module(f"benchmarks.{module}").main, [flag], capsys)
    assert message in err, err


def test_norm_kernels_refuses_a_layout_norm_it_cannot_time(capsys):
    """--norm=layernorm,dpn timed LayerNorm alone and said nothing of dpn (a patch-norm layout,
    not one layer); 'all' still leaves such norms out."""
    from benchmarks import norm_kernels
    err = refused(norm_kernels.main, ["--norm=layernorm,dpn,rescale"], capsys)
    assert "--norm: ['dpn', 'rescale'] change the model layout, not one layer" in err, err


@pytest.mark.parametrize("argv, message", [
    (["--norm_timeout=60"], "--norm_timeout and --isolate_dir need --isolate"),
    (["--isolate_dir=d"], "--norm_timeout and --isolate_dir need --isolate"),
    (["--isolate", "--one_process"], "--isolate and --one_process: choose one"),
])
def test_train_step_refuses_flags_it_would_ignore(argv, message, capsys):
    """Each ran without a word about the flag: --norm_timeout and --isolate_dir act only with
    --isolate, and --one_process took over from --isolate."""
    from benchmarks import train_step
    assert message in refused(train_step.main, TINY + argv, capsys)


def test_an_unknown_xla_preset_is_the_parsers_one_line_error():
    """xla_flags.apply() runs at import, before the parser: an unknown --xla_preset there was a
    bare message and exit 1, the code of a bug."""
    r = subprocess.run([sys.executable, "-m", "benchmarks.memory", "--xla_preset=bogus"],
                       cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert r.returncode == 2 and r.stderr.startswith(
        "python -m benchmarks.memory: error: argument --xla_preset: invalid choice: 'bogus'"), r.stderr


@pytest.mark.parametrize("module, argv, message", [
    ("compile_time", ["--layouts=unroled"], "--layouts: unknown ['unroled']"),  # ran as unrolled
    ("compile_time", ["--depths=12,x"], "--depths=12,x: accepted: a comma list of integers >= 1"),
    ("compile_time", ["--norm=bogus"], "--norm: unknown 'bogus'"),
    ("profile", ["--norm=layernorm,dtn"], "--norm: unknown 'layernorm,dtn'"),  # was a KeyError
    ("profile", ["--part=attn"], "--part: unknown 'attn'"),  # was an empty list of top ops
    ("train_step", ["--peak_tflops=-1"], "--peak_tflops=-1.0: must be > 0"),  # a negative MFU
])
def test_values_that_ran_wrong_or_crashed_are_refused(module, argv, message, capsys):
    err = refused(importlib.import_module(f"benchmarks.{module}").main, argv, capsys)
    assert message in err, err


def test_the_docs_name_every_entry_point_without_json():
    """docs/benchmarks.md said every entry point takes --json=FILE; fold_ops, gpu_table and
    norm_ablation do not. Each entry point of its table either has --json or is named in the
    opening paragraph as writing elsewhere."""
    from tests.test_tool_flags import _flags
    with open(os.path.join(REPO_ROOT, "docs", "benchmarks.md")) as f:
        text = f.read()
    opening = text.split("\n\n")[1]
    names = re.findall(r"^\| `(\w+)` \|", text.split("## XLA flags on CPU")[0], re.M)
    assert len(names) >= 14, names
    for name in names:
        if "--json" not in _flags(f"benchmarks.{name}"):
            assert f"`{name}`" in opening, (name, opening)


@pytest.mark.parametrize("module, argv, message", [
    ("fsdp", ["--norm=bogus"], "--norm: unknown 'bogus'"),  # a KeyError
    ("prepared_in_memory", ["--images=0"], "argument --images: 0 is not accepted"),  # silent exit 2
    ("prepared_in_memory", ["--skip=20"], "--skip=20: must be below --block=20"),  # nothing counted
    ("prepare_rate", ["--images=0"], "argument --images: 0 is not accepted"),  # a PrepareError
    ("norm_ablation", ["--seeds=a", "--summary_only"], "--seeds=a: accepted: a comma list"),
])
def test_the_other_entry_points_refuse_bad_values_in_one_line(module, argv, message, capsys):
    err = refused(importlib.import_module(f"benchmarks.{module}").main, argv, capsys)
    assert message in err, err


@pytest.mark.parametrize("module, argv, message", [
    # was a ValueError traceback (exit 1) after the demo runs, when the README was rewritten
    ("demo_table", ["--only=ln", "--seeds=1", "--root={d}/runs", "--readme={d}/README.md",
                    "--results={d}/r.json", "--config.total_steps=1"],
     "--readme={d}/README.md: the README needs one <!-- demo-table:begin --> ... "
     "<!-- demo-table:end --> pair around the demo table"),
    # was a PrepareError traceback (exit 1) after the JPEG folder's timing
    ("prepare_rate", ["--images=2", "--idx={d}/none"], "--idx={d}/none: not a folder (one of IDX files)"),
    # was a PrepareError traceback: one image is one class
    ("prepare_rate", ["--images=1"], "--images=1: accepted: an integer >= 2 (the images are "
                                     "spread over up to 10 classes; prepare needs two)"),
])
def test_benchmarks_without_run_entry_refuse_bad_input_in_one_line(module, argv, message,
                                                                     tmp_path):
    """docs/faults.md: the python -m benchmarks.<name> commands behave as the tools do; those
    that do not use common.run_entry stop on bad input with one line and exit 2, before the
    work, as a subprocess (the exit code and stderr a user sees)."""
    (tmp_path / "README.md").write_text("no demo table here\n")
    r = subprocess.run([sys.executable, "-m", f"benchmarks.{module}",
                        *(a.format(d=tmp_path) for a in argv)], cwd=REPO_ROOT,
                       capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert lines == [f"python -m benchmarks.{module}: error: " + message.format(d=tmp_path)]
    assert sorted(os.listdir(tmp_path)) == ["README.md"]  # nothing run, nothing written


def test_demo_table_rewrites_its_results_atomically(tmp_path, monkeypatch):
    """demo_table rewrites README.md, docs/analysis.md and the results JSON after a ~50-minute
    run; each was written in place, so a Ctrl-C then truncated it."""
    from benchmarks import demo_table
    path = tmp_path / "results.json"
    before = json.dumps({"written_by": "python -m benchmarks.demo_table", "methods": {}})
    path.write_text(before)
    ctrl_c_mid_write(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        demo_table.update_results(str(path), {}, {}, "2026-11-28")
    monkeypatch.undo()
    assert path.read_text() == before and os.listdir(tmp_path) == ["results.json"]


def test_profile_sums_a_step_by_kind_and_part():
    from benchmarks import profile
    res = profile.main(TINY + ["--batch=2", "--steps=1", "--part=norm", "--top=3"])
    assert {r["part"] for r in res["by_part"]} >= {"norm", "mlp", "attention"}
    assert res["top"] and all(r["part"] == "norm" for r in res["top"])
    # the header names the overridden depth, as train_step's does
    assert profile.report(res).startswith("profile: model=Ti/4 depth=1 norm=layernorm batch=2 ")
    assert all(r["ms_per_step"] > 0 for r in res["top"])  # tiny ops were rounded to 0.0
    assert [profile.ms(s) for s in (0.0000437, 0.0123456, 1.5)] == [0.0437, 12.3, 1500.0]


def test_write_json_is_whole_or_absent_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    from benchmarks import common
    path = tmp_path / "r.json"
    common.write_json(str(path), {"a": 1})
    real_replace = os.replace

    def interrupted(src, dst):  # a Ctrl-C between writing and renaming
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        common.write_json(str(path), {"a": 2})
    monkeypatch.setattr(os, "replace", real_replace)
    assert json.loads(path.read_text()) == {"a": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]


def test_fold_ops_counts_pow_exp_and_log_and_says_what_it_counts(capsys):
    """A walker's norm written with jnp.power (or exp/log) had 0 norm ops in every column: the
    primitives were not counted. They are columns now, and the output names the counted ones."""
    import jax
    import jax.numpy as jnp

    from benchmarks import fold_ops

    def soft_ln(x):
        v = jnp.var(x, axis=-1, keepdims=True)
        return x * jnp.power(v + 1e-5, -0.4) + jnp.log(jnp.exp(x))
    row = fold_ops._row(fold_ops.primitive_counts(jax.make_jaxpr(soft_ln)(jnp.ones((2, 4)))))
    assert (row["pow"], row["exp"], row["log"]) == (1, 1, 1)
    res = fold_ops.main(["--model=Ti/16", "--depth=1", "--norms=layernorm"])
    out = capsys.readouterr().out
    assert "counted primitives: rsqrt, sqrt, div, reduce_sum, reduce_max, reduce_min, tanh, erf, " \
           "pow, exp, log (any other only in 'all')" in out
    assert "| norm | folded | rsqrt | sqrt | div | reduce_sum | reduce_max | reduce_min | tanh | " \
           "erf | pow | exp | log | all |" in out
    ident = next(r for r in res if r["norm"] == "identity")
    assert ident["exp"] == 1 and ident["pow"] == 0  # the one block's attention softmax
