"""Smoke tests of every benchmark entry point on a tiny model: they run and report what they
promise. No timing assertions (timings belong in docs/benchmarks.md)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO_ROOT

TINY = ["--model=Ti/4", "--depth=1", "--image_size=8"]


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


def test_train_step_single_norm_with_options():
    from benchmarks import train_step
    res = train_step.main(TINY + ["--norm=unified", "--batch=4", "--steps=1", "--warmup=0",
                                  "--scan", "--remat", "--grad_accum=2"])
    assert res["peak_source"] == "probe" and res["peak_flops"] > 0
    assert "time_ratio" not in res["rows"][0]


def test_train_step_times_the_on_device_augmentation():
    from benchmarks import train_step
    res = train_step.main(TINY + ["--augment=none,deit", "--batch=4", "--steps=1", "--warmup=0",
                                  "--peak_tflops=1"])
    rows = {r["norm"]: r for r in res["rows"]}
    assert set(rows) == {"layernorm", "layernorm+deit"}
    assert rows["layernorm+deit"]["time_ratio_median"] > 0 and rows["layernorm+deit"]["within"] == "-"
    with pytest.raises(SystemExit, match="--augment: unknown"):
        train_step.main(TINY + ["--augment=autoaugment"])


def test_train_step_isolated_norms_each_in_a_process(tmp_path):
    from benchmarks import train_step
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


def test_gpu_table_dry_run_lists_the_commands(capsys):
    from benchmarks import gpu_table
    res = gpu_table.main(["--out=runs/gpu", "--dry-run"])
    text = capsys.readouterr().out
    assert "benchmarks.train_step --model=B/16 --norm=all --isolate" in text
    assert "benchmarks.vs_torch --model=S/16" in text and "--dtype=bfloat16" in text
    assert "benchmarks.input_pipeline --cores=1" in text
    assert "--norm=layernorm --augment=none,randaugment,deit" in text
    assert "benchmarks.input_pipeline --datasets=imagenet2012 --batch=256" in text
    assert "benchmarks.norm_kernels --norm=layernorm,batchnorm,repbn,progressive" in text
    assert len(res["commands"]) == 8


def test_gpu_table_tiny_writes_the_table_between_markers(tmp_path):
    from benchmarks import gpu_table
    doc = tmp_path / "doc.md"
    doc.write_text(f"# x\n{gpu_table.BEGIN}\nold\n{gpu_table.END}\nafter\n")
    res = gpu_table.main(["--tiny", "--no_torch", f"--out={tmp_path / 'out'}", f"--doc={doc}"])
    text = doc.read_text()
    assert "old" not in text and text.endswith(f"{gpu_table.END}\nafter\n")
    assert "| Ti/4 | layernorm |" in text and "| Ti/4 | rmsnorm |" in text
    assert "vs_torch: not run (--no_torch)" in text and "jax 0." in text
    assert "Host input pipeline" in text and "| 1 |" in text  # 1 core, headroom vs the LN step
    assert "| layernorm+deit |" in text and "| layernorm+randaugment |" in text
    assert "time the step waited for data" in text
    assert "Each norm layer alone, activation (2, 65, 192)" in text
    assert "| train | repbn |" in text and "| eval | progressive |" in text
    assert (tmp_path / "out" / "gpu_table.md").read_text().strip() == res["markdown"]


def test_inference():
    from benchmarks import inference
    res = inference.main(TINY + ["--norm=layernorm,batchnorm", "--batch=4", "--steps=1",
                                 "--warmup=0", "--fold"])
    rows = {r["norm"]: r for r in res["rows"]}
    assert list(rows) == ["layernorm", "batchnorm", "batchnorm+folded"]
    assert all(r["images_per_s"] > 0 for r in res["rows"])
    # Folding removes the norms' FLOPs (XLA's count of the compiled eval).
    assert 0 < rows["batchnorm+folded"]["flops_per_batch"] < rows["batchnorm"]["flops_per_batch"]


def test_input_pipeline_digits():
    from benchmarks import input_pipeline
    res = input_pipeline.main(["--datasets=digits", "--batches=2", "--steps=1", "--batch=16",
                               "--depth=1"])
    (row,) = res["rows"]
    assert row["source"] == "bundled" and row["pipeline_ex_s"] > 0 and row["step_ex_s"] > 0
    assert 0 <= row["wait_fraction"] <= 1


def test_input_pipeline_core_scaling():
    """--cores: the ImageNet pipeline alone in a child pinned to N cores (synthetic JPEGs)."""
    from benchmarks import input_pipeline
    res = input_pipeline.main(["--cores=1", "--batches=1", "--batch=8",
                               "--synthetic_examples=16"])
    (row,) = res["rows"]
    assert (row["cores"], row["workers"], row["source"]) == (1, 1, "synthetic JPEG")
    assert row["images_s"] > 0 and row["images_s_per_core"] == row["images_s"]
    assert row["efficiency"] == 1.0


def test_memory_fit():
    from benchmarks import memory
    res = memory.main(["--models=Ti/4", "--image_size=8", "--depth=1", "--probe_batches=8,64",
                       "--memory_gb=1", "--num_classes=10"])
    rows = {r["remat"]: r for r in res["rows"]}
    assert rows[False]["per_sample_MiB"] > 0 and rows[False]["max_batch@1GiB"] > 0
    # Activations, not just the input image (8*8*3 float32): XLA:CPU's own peak counted only that.
    assert rows[False]["per_sample_MiB"] * 2 ** 20 > 4 * 8 * 8 * 3 * 4
    assert rows[True]["per_sample_MiB"] <= rows[False]["per_sample_MiB"] * 1.05


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
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(j.read_text())


@pytest.mark.skipif(importlib.util.find_spec("torch") is None
                    or importlib.util.find_spec("timm") is None,
                    reason="torch/timm not installed (optional extra)")
def test_vs_torch(tmp_path):
    res = _vs_torch_subprocess(TINY + ["--batch=4", "--steps=1", "--warmup=1"], tmp_path)
    params = {r["impl"]: r["params"] for r in res["rows"]}
    assert params["jax"] == params["timm"]  # the same model on both sides
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


def test_gpu_table_timeout_budget_counts_every_norm():
    from benchmarks import common, gpu_table
    assert gpu_table.N_NORMS == len(common.NORMS)
    assert set(gpu_table.KERNEL_NORMS.split(",")) <= set(common.NORMS)


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


# ---- gpu_table --quick (benchmarks/gpu_quick.py) and what it runs ----

# Imported in every process of the tiny --quick run: the GPU host has neither.
NO_TENSORFLOW = ("import sys\n"
                 "for _m in ('tensorflow', 'tensorflow_datasets'):\n"
                 "    sys.modules[_m] = None  # import -> ImportError, as on the GPU host\n")


def test_gpu_table_quick_dry_run_lists_the_parts_with_their_shares(capsys):
    from benchmarks import gpu_table
    res = gpu_table.main(["--quick", "--dry-run", "--profile", "--budget_s=480",
                          "--variants=base=;lhs=--xla_gpu_enable_latency_hiding_scheduler=true"])
    text = capsys.readouterr().out
    assert "benchmarks.train_step --model=B/16 --one_process --batch=256" in text
    assert "--norm=layernorm,dtn --json=" in text
    assert "--norm=layernorm,repbn,progressive,zscore_repbn --json=" in text
    assert "--ln_variants=lhs=--xla_gpu_enable_latency_hiding_scheduler=true" in text
    assert "benchmarks.vs_torch --model=B/16,S/16 --batch=256 --dtype=bfloat16 --steps=10 --warmup=2" in text
    assert "benchmarks.norm_kernels --model=B/16 --norm=layernorm,dtn,repbn,progressive,zscore_repbn" in text
    assert "benchmarks.profile --model=B/16 --norm=layernorm" in text
    assert "input_pipeline" not in text and "--augment" not in text
    shares = [float(line.split(": ")[1].split(" s ")[0]) for line in text.splitlines()
              if line.startswith("# ")]
    assert len(shares) == len(res["commands"]) == 5 and abs(sum(shares) - 480) < 3
    assert text.index("benchmarks.vs_torch") < text.index("benchmarks.train_step")  # first


def test_gpu_table_quick_isolate_norms_gives_each_norm_a_part(capsys):
    from benchmarks import gpu_table
    gpu_table.main(["--quick", "--dry-run", "--isolate_norms", "--variants=lhs=--xla_a=true"])
    parts = [line.split(":")[0][2:] for line in capsys.readouterr().out.splitlines()
             if line.startswith("# ")]
    assert parts == ["vs_torch", "train_B16_layernorm", "train_B16_dtn", "train_B16_variants",
                     "train_S16_layernorm", "train_S16_repbn", "train_S16_progressive",
                     "train_S16_zscore_repbn", "train_S16_variants", "norm_kernels"]


def test_gpu_render_ratios_across_processes():
    """--isolate_norms: a norm's ratio to LN and its FLOP bound from the LN part of its model; a
    variants part's own LN row is left out, its variant keeps its same-process ratio."""
    from benchmarks import gpu_render
    row = lambda norm, s, extra=0.0, **kw: {"norm": norm, "step_median_s": s, "images_per_s": 1.0,
                                            "mfu": 0.3, "compile_s": 1.0, "model_gflops": 10.0,
                                            "norm_gflops": extra, **kw}
    part = lambda *rows: {"status": "ok", "result": {"args": {"model": "B/16"}, "rows": list(rows)}}
    parts = {"train_B16_layernorm": part(row("layernorm", 0.1, device_peak_gib=20.0)),
             "train_B16_dtn": part(row("dtn", 0.12, extra=1.0)),
             "train_B16_variants": part(row("layernorm", 0.2), row("layernorm@x", 0.19,
                                                                  time_ratio_median=0.95)),
             "vs_torch": {"status": "ok", "result": {"args": {"model": "B/16"}, "rows": [
                 {"impl": "timm_compiled", "step_median_s": 0.11, "images_per_s": 9.0}]}}}
    rows = {r["norm"]: r for r in gpu_render.summary_rows(parts)}
    assert list(rows) == ["layernorm", "dtn", "layernorm@x"]
    assert rows["dtn"]["ratio_to_ln"] == pytest.approx(1.2)
    assert rows["dtn"]["bound"] == pytest.approx(1.15) and rows["dtn"]["within"] == "NO"
    assert rows["layernorm@x"]["ratio_to_ln"] == 0.95 and rows["layernorm@x"]["bound"] is None
    assert rows["layernorm"]["vs_timm_compiled"] == pytest.approx(1.1)


def test_gpu_table_quick_tiny_runs_without_tensorflow(tmp_path):
    """The whole --quick run on CPU (tiny stand-ins, no torch) with TensorFlow and tfds made
    unimportable in every process: the parts run, the table and the JSON hold every norm."""
    block = tmp_path / "block"
    block.mkdir()
    (block / "sitecustomize.py").write_text(NO_TENSORFLOW)
    env = {**os.environ, "PYTHONPATH": f"{block}{os.pathsep}{REPO_ROOT}"}
    probe = subprocess.run([sys.executable, "-c", "import tensorflow"], env=env,
                           capture_output=True, text=True)
    assert probe.returncode != 0 and "tensorflow" in probe.stderr  # the block holds
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "benchmarks.gpu_table", "--quick", "--tiny",
                        "--no_torch", "--profile", f"--out={out}", "--budget_s=1500"],
                       cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((out / "gpu_table.json").read_text())
    status = {n: p["status"] for n, p in res["parts"].items()}
    assert status == {"vs_torch": "not run", "train_B16": "ok", "train_S16": "ok",
                      "norm_kernels": "ok", "profile": "ok"}, res["parts"]
    rows = {(r["model"], r["norm"]) for r in res["summary"]}
    assert rows == {("Ti/8", "layernorm"), ("Ti/8", "dtn"), ("Ti/4", "layernorm"),
                    ("Ti/4", "repbn"), ("Ti/4", "progressive"), ("Ti/4", "zscore_repbn")}
    ln = [r for r in res["summary"] if r["norm"] == "layernorm"]
    assert all(r["ratio_to_ln"] == 1.0 and r["step_s"] > 0 for r in ln)
    md = (out / "gpu_table.md").read_text()
    assert "| Ti/4 | zscore_repbn |" in md and "| train | dtn |" in md
    assert "| kind | ms/step | share |" in md and "- vs_torch: not run: --no_torch" in md
    for part in ("train_B16", "train_S16", "norm_kernels", "profile"):
        assert (out / f"{part}.log").exists() and (out / f"{part}.json").exists()


def test_gpu_quick_stops_a_part_at_its_share_and_keeps_what_it_wrote(tmp_path):
    """A part past its share is killed with its children; its JSON so far is read back."""
    from benchmarks import gpu_quick
    j, pid = tmp_path / "part.json", tmp_path / "child.pid"
    code = ("import json, subprocess, sys, time\n"
            f"c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            f"open({str(pid)!r}, 'w').write(str(c.pid))\n"
            f"json.dump({{'rows': [1], 'pending': ['b']}}, open({str(j)!r}, 'w'))\n"
            "time.sleep(60)\n")
    p = gpu_quick.run_part([sys.executable, "-c", code], str(j), str(tmp_path / "part.log"), 5.0,
                           dict(os.environ))
    assert p["status"] == "timeout" and p["result"] == {"rows": [1], "pending": ["b"]}
    assert p["seconds"] < 30
    child = int(pid.read_text())
    for _ in range(50):  # the grandchild went with the group
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the part's child survived")
    failed = gpu_quick.run_part([sys.executable, "-c", "raise SystemExit('boom')"],
                                str(tmp_path / "none.json"), str(tmp_path / "f.log"), 30.0,
                                dict(os.environ))
    assert failed["status"] == "failed" and "boom" in failed["reason"]


def test_gpu_quick_reports_parts_left_without_time(tmp_path):
    from benchmarks import gpu_table
    res = gpu_table.main(["--quick", "--tiny", "--no_torch", f"--out={tmp_path}", "--budget_s=5"])
    assert {p["status"] for n, p in res["parts"].items() if n != "vs_torch"} == {"skipped"}
    assert "- train_B16: skipped: --budget_s spent" in res["markdown"]
    assert json.loads((tmp_path / "gpu_table.json").read_text())["parts"]["norm_kernels"][
        "status"] == "skipped"


def test_train_step_one_process_with_xla_flag_variants(tmp_path):
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
    with pytest.raises(SystemExit, match="need --one_process"):
        train_step.main(TINY + ["--ln_variants=a=--xla_x=1"])


def test_xla_flag_variants_parse():
    from benchmarks import xla_flags
    assert xla_flags.parse_variants("base=; lhs=--xla_a=true --xla_b=4") == [
        ("base", ""), ("lhs", "--xla_a=true --xla_b=4")]
    assert xla_flags.flag_options("--xla_a=true --xla_b=4 --xla_c=False") == {
        "xla_a": True, "xla_b": "4", "xla_c": False}
    for bad in ("lhs", "a b=--x=1", "a=--x=1;a=--y=2", "a=xla_x=1"):
        with pytest.raises(SystemExit):
            xla_flags.parse_variants(bad)


def test_benchmarks_import_without_tensorflow():
    """What the GPU host imports: gpu_table (and --quick's parts) with TensorFlow and tfds absent."""
    code = NO_TENSORFLOW + ("import benchmarks.gpu_table, benchmarks.gpu_quick, benchmarks.train_step, "
                            "benchmarks.norm_kernels, benchmarks.vs_torch, benchmarks.profile\n"
                            "assert sys.modules['tensorflow'] is None\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]


def test_prepared_in_memory_times_the_three_pipelines():
    from benchmarks import prepared_in_memory
    res = prepared_in_memory.main(["--config=configs/vit_ln.py:demo", "--images=40",
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
