"""Smoke tests of benchmarks.gpu_table (the full run and ``--quick``, benchmarks/gpu_quick.py) on
tiny models: they run every part and write the table they promise. No timing assertions. Split
from tests/test_benchmarks.py so that the two files' subprocess-heavy runs share the workers
(``--dist loadfile`` runs a file on one worker).

The tiny runs' children compile with XLA's backend optimizations off (tests/deploy_runs.XLA_FAST,
through gpu_table's own ``--xla_flags``): their compiles are these tests' time, and the tests
check the plumbing and the table, not what XLA's optimizations make of the step."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time

import pytest

from tests.conftest import REPO_ROOT, ctrl_c_mid_write
from tests.deploy_runs import XLA_FAST

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
    res = gpu_table.main(["--tiny", "--no_torch", f"--out={tmp_path / 'out'}", f"--doc={doc}",
                          f"--xla_flags={XLA_FAST}"])
    text = doc.read_text()
    assert "old" not in text and text.endswith(f"{gpu_table.END}\nafter\n")
    assert "| Ti/4 | layernorm |" in text and "| Ti/4 | rmsnorm |" in text
    ln_row = next(x for x in text.splitlines() if x.startswith("| Ti/4 | layernorm |"))
    assert ln_row.split(" | ")[6].endswith(" (XLA est.)"), ln_row  # CPU: no device peak
    assert "vs_torch: not run (--no_torch)" in text and "jax 0." in text
    assert "Host input pipeline" in text and "| 1 |" in text  # 1 core, headroom vs the LN step
    assert "| layernorm+deit |" in text and "| layernorm+randaugment |" in text
    assert "time the step waited for data" in text
    assert "Each norm layer alone, activation (2, 65, 192)" in text
    assert "| train | repbn |" in text and "| eval | progressive |" in text
    assert (tmp_path / "out" / "gpu_table.md").read_text().strip() == res["markdown"]


def test_gpu_table_timeout_budget_counts_every_norm():
    """Registry-only norms (a norm added to the registry without a benchmarks.common entry) run
    under --norm=all too: N_NORMS was a fixed 22 that left them out of the timeout budget."""
    from benchmarks import common, gpu_table
    assert gpu_table.NORM_NAMES == list(common.NORMS)  # read from the files, jax not imported
    assert gpu_table.REGISTRY_ONLY == common.REGISTRY_ONLY
    assert gpu_table.N_NORMS == len(common.NORMS)
    assert set(gpu_table.KERNEL_NORMS.split(",")) <= set(common.NORMS)


def test_gpu_table_tiny_keeps_an_explicit_norm_and_refuses_an_unknown_one(capsys, monkeypatch):
    """--tiny replaced an explicit --norm by layernorm,rmsnorm silently, and --norm=bogus was
    only refused by train_step, in a log, after the other runs; a registry-only norm named by
    --norm was not in the norm_kernels rows."""
    from benchmarks import gpu_table

    def plan(*argv):  # {run name: (command, timeout)}
        cmds = gpu_table.commands(gpu_table.parse(["--out=runs/gpu", "--dry-run", *argv]))
        return {name: (" ".join(c), t) for name, c, _, t in cmds}

    gpu_table.main(["--out=runs/gpu", "--tiny", "--dry-run", "--norm=dyt,derf"])
    assert "benchmarks.train_step --model=Ti/4 --norm=dyt,derf --isolate" in capsys.readouterr().out
    cmd, timeout = plan("--tiny", "--norm=dyt,derf")["train_Ti4"]
    assert "--norm=dyt,derf" in cmd and timeout == 300.0 * 3 + 120  # + LayerNorm's baseline
    assert "--norm=layernorm,rmsnorm" in plan("--tiny")["train_Ti4"][0]  # the default of --tiny
    assert plan("--norm=all")["train_B16"][1] == 300.0 * gpu_table.N_NORMS + 120

    with pytest.raises(SystemExit) as e:
        gpu_table.main(["--out=runs/gpu", "--dry-run", "--norm=layernorm,bogus"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith("python -m benchmarks.gpu_table: error: --norm: unknown ['bogus']; "
                          "accepted: 'all' or a comma list of ['layernorm', 'rmsnorm', "), err

    # a norm of the registry only (a walker's soft_ln): in the kernel rows when --norm runs it
    monkeypatch.setattr(gpu_table, "NORM_NAMES", [*gpu_table.NORM_NAMES, "soft_ln"])
    monkeypatch.setattr(gpu_table, "REGISTRY_ONLY", [*gpu_table.REGISTRY_ONLY, "soft_ln"])
    for norm in ("soft_ln", "all"):
        assert f"--norm={gpu_table.KERNEL_NORMS},soft_ln " in plan(f"--norm={norm}")[
            "norm_kernels"][0]
    assert f"--norm={gpu_table.KERNEL_NORMS} " in plan("--norm=dyt")["norm_kernels"][0]


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
    assert "--norm=layernorm,dtn_pallas,dtn --json=" in text
    assert "--norm=layernorm,repbn,progressive,zscore_repbn --json=" in text
    assert "--ln_variants=lhs=--xla_gpu_enable_latency_hiding_scheduler=true" in text
    assert "benchmarks.vs_torch --model=B/16,S/16 --batch=256 --dtype=bfloat16 --steps=10 --warmup=2" in text
    assert ("benchmarks.norm_kernels --model=B/16 "
            "--norm=layernorm,dtn,dtn_pallas,repbn,progressive,zscore_repbn") in text
    assert "benchmarks.profile --model=B/16 --norm=layernorm" in text
    assert "input_pipeline" not in text and "--augment" not in text
    shares = [float(line.split(": ")[1].split(" s ")[0]) for line in text.splitlines()
              if line.startswith("# ")]
    assert len(shares) == len(res["commands"]) == 5 and abs(sum(shares) - 480) < 3
    assert text.index("benchmarks.vs_torch") < text.index("benchmarks.train_step")  # first


def test_gpu_table_quick_parts_selects_and_rejects(capsys):
    """--parts runs only the named parts (the budget shared by their weights); a train part's
    name selects its per-norm parts under --isolate_norms; an unknown name exits 2 naming it."""
    from benchmarks import gpu_table
    res = gpu_table.main(["--quick", "--dry-run", "--parts=norm_kernels,train_S16",
                          "--budget_s=300"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("# ")]
    assert [line.split(":")[0][2:] for line in lines] == ["train_S16", "norm_kernels"]
    assert "benchmarks.vs_torch" not in " ".join(map(" ".join, res["commands"]))
    assert sum(float(line.split(": ")[1].split(" s ")[0]) for line in lines) == pytest.approx(300, abs=2)
    gpu_table.main(["--quick", "--dry-run", "--recompute=gelu", "--parts=train_S16_recompute"])
    text = capsys.readouterr().out
    assert [line.split(":")[0][2:] for line in text.splitlines() if line.startswith("# ")] == [
        "train_S16_recompute"]
    gpu_table.main(["--quick", "--dry-run", "--recompute=gelu", "--parts=train_S16,norm_kernels"])
    assert [line.split(":")[0][2:] for line in capsys.readouterr().out.splitlines()
            if line.startswith("# ")] == ["train_S16", "norm_kernels"]  # not its _recompute part
    assert "--model=S/16 --one_process" in text and "--norm=layernorm --recompute=gelu" in text
    gpu_table.main(["--quick", "--dry-run", "--stream_layout=free", "--recompute=gelu",
                    "--parts=train_B16,train_B16_stream"])
    text = capsys.readouterr().out
    assert [line.split(":")[0][2:] for line in text.splitlines() if line.startswith("# ")] == [
        "train_B16", "train_B16_stream"]  # the train part's name selects neither extra part
    assert "--norm=layernorm --stream_layout=free" in text
    gpu_table.main(["--quick", "--dry-run", "--isolate_norms", "--parts=train_B16"])
    assert [line.split(":")[0][2:] for line in capsys.readouterr().out.splitlines()
            if line.startswith("# ")] == ["train_B16_layernorm", "train_B16_dtn_pallas",
                                          "train_B16_dtn"]
    r = subprocess.run([sys.executable, "-m", "benchmarks.gpu_table", "--quick", "--dry-run",
                        "--parts=vs_torch,trian_S16"], cwd=REPO_ROOT, capture_output=True, text=True)
    assert r.returncode == 2 and "unknown part(s) ['trian_S16']" in r.stderr
    assert "Traceback" not in r.stderr


def test_gpu_table_quick_isolate_norms_gives_each_norm_a_part(capsys):
    from benchmarks import gpu_table
    gpu_table.main(["--quick", "--dry-run", "--isolate_norms", "--variants=lhs=--xla_a=true"])
    parts = [line.split(":")[0][2:] for line in capsys.readouterr().out.splitlines()
             if line.startswith("# ")]
    assert parts == ["vs_torch", "train_B16_layernorm", "train_B16_dtn_pallas", "train_B16_dtn",
                     "train_B16_variants",
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
             "train_B16_recompute": {"status": "ok", "result": {
                 "args": {"model": "B/16", "recompute": "gelu"},
                 "rows": [row("layernorm", 0.103, device_peak_gib=17.0)]}},
             "train_B16_stream": {"status": "ok", "result": {
                 "args": {"model": "B/16", "recompute": None, "stream_layout": "free"},
                 "rows": [row("layernorm", 0.11)]}},
             "vs_torch": {"status": "ok", "result": {"args": {"model": "B/16"}, "rows": [
                 {"impl": "timm_compiled", "step_median_s": 0.11, "images_per_s": 9.0}]}}}
    rows = {r["norm"]: r for r in gpu_render.summary_rows(parts)}
    assert list(rows) == ["layernorm", "dtn", "layernorm@x", "layernorm+recompute=gelu",
                          "layernorm+stream_layout=free"]
    assert rows["layernorm+stream_layout=free"]["ratio_to_ln"] == pytest.approx(1.1)
    rec = rows["layernorm+recompute=gelu"]  # against the plain LN row of its model
    assert rec["ratio_to_ln"] == pytest.approx(1.03) and rec["device_peak_gib"] == 17.0
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
                        "--no_torch", "--profile", f"--out={out}", "--budget_s=1500",
                        f"--xla_flags={XLA_FAST}"],
                       cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((out / "gpu_table.json").read_text())
    status = {n: p["status"] for n, p in res["parts"].items()}
    assert status == {"vs_torch": "not run", "train_B16": "ok", "train_S16": "ok",
                      "norm_kernels": "ok", "profile": "ok"}, res["parts"]
    rows = {(r["model"], r["norm"]) for r in res["summary"]}
    assert rows == {("Ti/8", "layernorm"), ("Ti/8", "dtn"), ("Ti/8", "dtn_pallas"),
                    ("Ti/4", "layernorm"),
                    ("Ti/4", "repbn"), ("Ti/4", "progressive"), ("Ti/4", "zscore_repbn")}
    ln = [r for r in res["summary"] if r["norm"] == "layernorm"]
    assert all(r["ratio_to_ln"] == 1.0 and r["step_s"] > 0 for r in ln)
    # the train parts' second pass, every step round-robin (--interleave_rounds)
    assert all(r["interleaved"] == 1.0 for r in ln)
    assert all(r["interleaved"] > 0 for r in res["summary"])
    md = (out / "gpu_table.md").read_text()
    assert "| Ti/4 | zscore_repbn |" in md and "| train | dtn |" in md
    assert "| kind | ms/step | share |" in md and "- vs_torch: not run: --no_torch" in md
    for part in ("train_B16", "train_S16", "norm_kernels", "profile"):
        assert (out / f"{part}.log").exists() and (out / f"{part}.json").exists()
    with tarfile.open(out / "gpu_table_bundle.tar.gz") as tar:  # what a GPU lease returns
        names = set(tar.getnames())
        assert json.load(tar.extractfile("gpu_table.json"))["parts"].keys() == res["parts"].keys()
    assert names == {p.name for p in out.iterdir() if p.suffix in (".log", ".json", ".md")}
    assert {"train_S16.log", "norm_kernels.json", "gpu_table.md"} <= names


def test_gpu_quick_stops_a_part_at_its_share_and_keeps_what_it_wrote(tmp_path):
    """A part past its share is killed with its children; its JSON so far is read back."""
    from benchmarks import gpu_quick
    j, pid = tmp_path / "part.json", tmp_path / "child.pid"
    code = ("import json, subprocess, sys, time\n"
            f"c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            f"open({str(pid)!r}, 'w').write(str(c.pid))\n"
            f"json.dump({{'rows': [1], 'pending': ['b']}}, open({str(j)!r}, 'w'))\n"
            "time.sleep(60)\n")
    # a 3 s share (was 5: the test waited it out): the part writes its JSON and child within its
    # first ~0.1 s (a bare interpreter, no jax)
    p = gpu_quick.run_part([sys.executable, "-c", code], str(j), str(tmp_path / "part.log"), 3.0,
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


def test_benchmarks_import_without_tensorflow():
    """What the GPU host imports: gpu_table (and --quick's parts) with TensorFlow and tfds absent."""
    code = NO_TENSORFLOW + ("import benchmarks.gpu_table, benchmarks.gpu_quick, benchmarks.train_step, "
                            "benchmarks.norm_kernels, benchmarks.vs_torch, benchmarks.profile\n"
                            "assert sys.modules['tensorflow'] is None\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.parametrize("argv, message", [
    (["--out=/proc/gpu"], "--out=/proc/gpu: cannot write in /proc"),
    (["--doc={tmp}/none.md"], "--doc={tmp}/none.md: cannot be read (FileNotFoundError"),
    (["--doc={tmp}/plain.md"], "--doc={tmp}/plain.md: needs the markers"),
    (["--quick", "--doc={tmp}/plain.md"], "--doc={tmp}/plain.md: needs the markers"),
    (["--steps=0"], "argument --steps: 0 is not accepted"),
])
def test_gpu_table_checks_out_and_doc_before_the_runs(argv, message, tmp_path, capsys):
    """An unwritable --out was a traceback once the first part was due, a --doc without the
    markers a bare message with exit 1 after the whole run (20-40 minutes on a GPU)."""
    from benchmarks import gpu_table
    (tmp_path / "plain.md").write_text("no markers\n")
    argv = [a.format(tmp=tmp_path) for a in argv]
    with pytest.raises(SystemExit) as e:
        gpu_table.main(argv + ([] if any(a.startswith("--out") for a in argv)
                               else [f"--out={tmp_path}/out"]))
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert message.format(tmp=tmp_path) in err, err
    assert not (tmp_path / "out").exists()


def test_gpu_table_rewrites_the_doc_atomically(tmp_path, monkeypatch):
    """--doc is docs/benchmarks.md: a Ctrl-C while it is written must leave it whole."""
    from benchmarks import gpu_table
    doc = tmp_path / "doc.md"
    before = f"# x\n{gpu_table.BEGIN}\nold\n{gpu_table.END}\nafter\n"
    doc.write_text(before)
    ctrl_c_mid_write(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        gpu_table.write_between_markers(str(doc), "new")
    monkeypatch.undo()
    assert doc.read_text() == before


@pytest.mark.parametrize("flag", ["--variants=lhs=--xla_gpu_x=true", "--budget_s=300", "--profile",
                                  "--isolate_norms", "--recompute=gelu", "--compile_cache=c",
                                  "--stream_layout=free", "--parts=train_B16"])
def test_gpu_table_quick_only_flags_are_refused_without_quick(flag, capsys):
    """The full run ignored them without a word (only --parts was refused)."""
    from benchmarks import gpu_table
    with pytest.raises(SystemExit) as e:
        gpu_table.main(["--dry-run", flag])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert f"{flag.split('=')[0]}: applies to --quick only" in err, err


@pytest.mark.parametrize("variants, message", [
    ("bad", "--variants: 'bad' is not NAME=FLAGS"),
    ("a=--xla_x", "XLA flag '--xla_x': expected --name=value"),
    ("a=--xla_x=1;a=--xla_y=2", "--variants: names repeat"),
])
def test_gpu_table_bad_variants_is_one_line_and_exit_2(variants, message, capsys):
    """docs/benchmarks.md: bad input is one line `python -m benchmarks.<name>: error: ...` and exit
    2; a malformed --variants was xla_flags' bare SystemExit (exit 1, no tool name)."""
    from benchmarks import gpu_table
    with pytest.raises(SystemExit) as e:
        gpu_table.main(["--quick", "--dry-run", f"--variants={variants}"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith("python -m benchmarks.gpu_table: error: ") and message in err, err


def test_gpu_table_refused_quick_run_leaves_no_temporary_cache(tmp_path, monkeypatch, capsys):
    """--quick without --compile_cache makes a temporary cache folder, removed at the end of the
    run; a command refused at parse (an --out that cannot be written) must not leave it behind."""
    import tempfile

    from benchmarks import gpu_table
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    with pytest.raises(SystemExit) as e:
        gpu_table.main(["--quick", "--out=/proc/gpu"])
    assert e.value.code == 2, capsys.readouterr().err
    assert list(tmp.iterdir()) == []


def test_gpu_table_peak_column_marks_only_an_estimate_it_has():
    """The full run's peak GiB: the device's peak, else XLA's estimate marked '(XLA est.)', else
    '-' (a row with neither read '- (XLA est.)', an estimate that is not there)."""
    import argparse

    from benchmarks import gpu_table
    row = {"norm": "layernorm", "step_s": "0.1", "images_per_s": 10.0, "model_gflops": 1.0,
           "mfu": 0.5, "compile_s": 1.0}
    rows = [dict(row, device_peak_gib=2.0), dict(row, norm="rmsnorm", xla_peak_gib=3.0),
            dict(row, norm="dyt")]
    args = argparse.Namespace(batch=4, dtype="float32", num_classes=10, steps=1, warmup=0,
                              out="runs/gpu", xla_flags="")
    md = gpu_table.render({"train_Ti4": {"args": {"model": "Ti/4"}, "rows": rows}}, [], args)
    peaks = {x.split(" | ")[1]: x.split(" | ")[6] for x in md.splitlines()
             if x.startswith("| Ti/4 |")}
    assert peaks == {"layernorm": "2", "rmsnorm": "3 (XLA est.)", "dyt": "-"}, md
