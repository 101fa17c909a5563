"""benchmarks.gpu_hlo: the kernel census of an optimized HLO module, checked on what XLA:CPU makes
of the train step (the same HLO text format and op_name metadata as XLA:GPU's); the deviceless
GPU compile itself needs jax's CUDA plugin (5 GB), which CI does not install: without it the tool
exits 2 in one line naming the install command."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from benchmarks import gpu_hlo
from tests.conftest import REPO_ROOT


def test_array_bytes_of_arrays_and_tuples():
    assert gpu_hlo.array_bytes("f32[2,3]{1,0}") == 24
    assert gpu_hlo.array_bytes("(f32[2,3]{1,0}, bf16[4]{0}, s32[])") == 24 + 8 + 4
    assert gpu_hlo.array_bytes("pred[10]") == 10


def test_part_from_op_names():
    name = ("jit(train_step)/transpose(jvp(ViT))/Transformer/encoderblock_5/"
            "encoderblock_5._block/LayerNorm_2/n2/bn/mul")
    assert gpu_hlo._part(name) == ("LayerNorm_2", True, 5)
    assert gpu_hlo._part("jit(train_step)/jvp(ViT)/Transformer/encoder_norm/sub") == (
        "encoder_norm", False, None)
    assert gpu_hlo._part("jit(train_step)/jvp(ViT)/Transformer/encoderblock_0/"
                         "encoderblock_0._block/add") == ("(block: residual adds)", False, 0)
    assert gpu_hlo._part(None)[0] == "(no op name)"


def test_census_of_the_train_step_as_xla_compiles_it():
    from benchmarks import common
    cfg = common.bench_config("Ti/4", "layernorm", image_size=8, batch=4, depth=2)
    lowered, _ = common.lower_abstract_train_step(cfg)
    kernels = gpu_hlo.census(lowered.compile().as_text())
    blocks = {k.block for k in kernels if k.block is not None}
    assert blocks == {0, 1}
    parts = {(k.part, k.backward) for k in kernels if k.block == 1}
    for part in ("LayerNorm_0", "LayerNorm_2", "MlpBlock_3"):
        assert (part, False) in parts and (part, True) in parts, (part, sorted(parts))
    # Every kernel's bytes are those of its operands and results: the largest any kernel can read
    # is bounded by all the arrays of the step, and the matmuls of the MLP read their activations.
    mlp = [k for k in kernels if k.block == 1 and k.part == "MlpBlock_3" and not k.backward]
    width = 192 * 4  # Ti hidden width x 4, float32 activations (4 images of 4 tokens + class)
    assert max(k.bytes_in + k.bytes_out for k in mlp) >= 4 * 5 * width * 4
    s = gpu_hlo.summarize(kernels, bandwidth=1e12)
    assert s["kernels"] == len(kernels) and s["blocks"] == 2
    assert np.isclose(s["mem_bound_est_ms"], s["mem_bound_gb"] * 1e9 / 1e12 * 1e3)
    assert sum(v["kernels"] for v in s["by_kind"].values()) == len(kernels)
    block_mb = sum(d["all_mb"] for d in s["per_block_part"].values()) * 2
    in_blocks = sum(k.bytes_in + k.bytes_out for k in kernels if k.block is not None) / 1e6
    assert np.isclose(block_mb, in_blocks)


def test_without_the_cuda_plugin_it_says_how_to_install_it(tmp_path):
    r = subprocess.run([sys.executable, "-m", "benchmarks.gpu_hlo", f"--site={tmp_path}/none",
                        "--depth=1"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.strip().splitlines() if line]
    assert len(lines) == 1 and "pip install --target" in lines[0] and "jax-cuda12-plugin" in lines[0]


def test_config_overrides_and_a_bad_one_in_one_line(tmp_path):
    assert gpu_hlo.overrides(["model.attention_impl='separate'", "model.depth=2"]) == [
        ("model.attention_impl", "separate"), ("model.depth", 2)]
    r = subprocess.run([sys.executable, "-m", "benchmarks.gpu_hlo", "--set=model.depth"],
                       cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    lines = [line for line in r.stderr.strip().splitlines() if line]
    assert len(lines) == 1 and "--set='model.depth'" in lines[0], r.stderr


def test_an_unknown_norm_is_one_line_and_exit_2(capsys):
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:  # it exited 1, the code of a bug
        gpu_hlo.main(["--norm=layernorm,bogus", "--depth=1"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "unknown ['bogus']" in err, err


def test_buffers_at_the_memory_peak_grouped_by_what_made_them(tmp_path):
    """--peak: XLA's live-range report of the real train step (XLA:CPU writes the same report as
    XLA:GPU), grouped: the parameters and optimizer state are the state's arrays, the
    activations are named by block part with the blocks folded together, and the whole is what
    XLA's memory analysis says the step holds."""
    import jax
    from benchmarks import common
    # activations well above the state, as in any real step: the peak falls before the update
    cfg = common.bench_config("Ti/4", "layernorm", image_size=32, batch=64, depth=2)
    lowered, state = common.lower_abstract_train_step(cfg)
    compiled = lowered.compile(compiler_options=gpu_hlo.dump_options(str(tmp_path)))
    groups = gpu_hlo.peak_groups(gpu_hlo.live_range_text(str(tmp_path)), compiled.as_text())
    got = {g["what"]: g["bytes"] for g in groups}
    nbytes = lambda tree: sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree))  # noqa: E731
    # the whole state but the few small arrays whose update XLA schedules before the peak (the
    # head's bias, whose gradient is the first the backward has: their new values count there)
    for what, tree in (("parameters", state.params), ("optimizer state", state.opt_state)):
        assert 0.99 * nbytes(tree) <= got[what] <= nbytes(tree), (what, got[what], nbytes(tree))
    assert [g["bytes"] for g in groups] == sorted((g["bytes"] for g in groups), reverse=True)
    assert any(w.startswith("forward MlpBlock_3, all blocks: ") for w in got), list(got)
    blocks = sum(b for w, b in got.items() if ", all blocks: " in w)
    assert blocks > got["parameters"] + got["optimizer state"], got
    stats = compiled.memory_analysis()
    total = sum(got.values())
    assert stats.argument_size_in_bytes < total <= stats.argument_size_in_bytes + stats.temp_size_in_bytes + 2**20


_SLICING = """HloModule m

%fused_slice (param_0.1: bf16[8,5,64]) -> f32[8,5,1] {
  %param_0.1 = bf16[8,5,64]{2,1,0} parameter(0)
  %convert.1 = f32[8,5,64]{2,1,0} convert(%param_0.1)
  ROOT %slice.1 = f32[8,5,1]{2,1,0} slice(%convert.1), slice={[0:8], [0:5], [0:1]}
}

%fused_mixed (param_0.2: bf16[8,5,64], param_1.2: f32[8,5,1]) -> bf16[8,5,64] {
  %param_0.2 = bf16[8,5,64]{2,1,0} parameter(0)
  %bitcast.2 = bf16[40,64]{1,0} bitcast(%param_0.2)
  %slice.2 = bf16[40,1]{1,0} slice(%bitcast.2), slice={[0:40], [0:1]}
  %param_1.2 = f32[8,5,1]{2,1,0} parameter(1)
  %convert.2 = f32[8,5,64]{2,1,0} convert(%param_0.2)
  ROOT %r = bf16[8,5,64]{2,1,0} convert(%convert.2)
}

ENTRY %main (p0: bf16[8,5,64]) -> bf16[8,5,64] {
  %p0 = bf16[8,5,64]{2,1,0} parameter(0)
  %loop_slice_fusion = f32[8,5,1]{2,1,0} fusion(%p0), kind=kLoop, calls=%fused_slice
  ROOT %loop_convert_fusion = bf16[8,5,64]{2,1,0} fusion(%p0, %loop_slice_fusion), kind=kLoop, calls=%fused_mixed
}
"""


def test_an_operand_read_only_through_slices_counts_the_slices():
    """A kernel that converts a (8, 5, 64) bfloat16 operand and keeps each row's first element
    reads 40 of its elements (80 bytes), not 5,120 bytes; one that also reads it whole counts it
    whole."""
    sliced, mixed = gpu_hlo.census(_SLICING)
    assert (sliced.bytes_in, sliced.bytes_out) == (40 * 2, 40 * 4)
    assert (mixed.bytes_in, mixed.bytes_out) == (8 * 5 * 64 * 2 + 40 * 4, 8 * 5 * 64 * 2)


def test_pallas_lowering_is_told_the_described_card_and_it_is_restored(monkeypatch):
    """jax 0.11's Pallas Triton lowering asks ``gpu_info.get_gpu_info()`` for the local GPU and
    refuses a CPU: during the compile it answers with the target card, afterwards the real
    function is back; under jax 0.10 (no such module) nothing is touched."""
    import types

    import jax._src.pallas.triton as triton_package
    name = "jax._src.pallas.triton.gpu_info"

    def refuse():
        raise ValueError("Unsupported GPU device kind: cpu")

    versions = types.SimpleNamespace(H100="NVIDIA H100", H200="NVIDIA H200")
    fake = types.SimpleNamespace(GpuVersion=versions, get_gpu_info=refuse,
                                 get_gpu_info_from_version=lambda v: ("info", v))
    monkeypatch.setitem(sys.modules, name, fake)
    monkeypatch.setattr(triton_package, "gpu_info", fake, raising=False)
    for target, card in (("h100", "NVIDIA H100"), ("h200", "NVIDIA H200")):
        with gpu_hlo._pallas_sees(target):
            assert fake.get_gpu_info() == ("info", card)
        assert fake.get_gpu_info is refuse
    try:
        with gpu_hlo._pallas_sees("h100"):
            raise RuntimeError("the compile failed")
    except RuntimeError:
        pass
    assert fake.get_gpu_info is refuse  # restored on an error too
    monkeypatch.setitem(sys.modules, name, None)  # jax 0.10: the import fails
    monkeypatch.delattr(triton_package, "gpu_info", raising=False)
    with gpu_hlo._pallas_sees("h100"):
        pass


_PTXAS_REPORT = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'dtn_forward' for 'sm_90a'
ptxas info    : Function properties for dtn_forward
    0 bytes stack frame, 120 bytes spill stores, 96 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers
ptxas info    : Compiling entry function 'loop_add_fusion' for 'sm_90a'
ptxas info    : Function properties for loop_add_fusion
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 18 registers
"""


def test_registers_and_spills_of_the_named_kernels_from_ptxas(tmp_path, monkeypatch):
    """--registers: ptxas -v's report read per entry function; only PTX files holding a kernel
    whose name matches are compiled, only matching entries reported; none matching, or no
    ptxas, is a one-line exit naming what is missing."""
    assert gpu_hlo.ptxas_usage(_PTXAS_REPORT) == {
        "dtn_forward": {"registers": 255, "spill_stores": 120, "spill_loads": 96},
        "loop_add_fusion": {"registers": 18, "spill_stores": 0, "spill_loads": 0}}
    dump = tmp_path / "dump"
    dump.mkdir()
    (dump / "module.1.ptx").write_text(".visible .entry dtn_forward(\n.param .u64 a\n)\n"
                                       ".visible .entry loop_add_fusion(\n)\n")
    (dump / "module.2.ptx").write_text(".visible .entry loop_add_fusion(\n)\n")
    (dump / "module.1.txt").write_text(".entry dtn_forward(")  # not PTX: not read
    calls = tmp_path / "calls"
    ptxas = tmp_path / "ptxas"
    ptxas.write_text(f"#!/bin/sh\necho \"$3\" >> {calls}\ncat <<'R' >&2\n{_PTXAS_REPORT}R\n")
    ptxas.chmod(0o755)
    rows = gpu_hlo.kernel_registers(str(dump), "dtn_", str(ptxas))
    assert rows == [{"kernel": "dtn_forward", "registers": 255, "spill_stores": 120,
                     "spill_loads": 96}]
    assert calls.read_text().split() == [str(dump / "module.1.ptx")]  # module.2 never compiled
    with pytest.raises(SystemExit, match="no PTX kernel of that name"):
        gpu_hlo.kernel_registers(str(dump), "rms_", str(ptxas))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(SystemExit) as stop:
        gpu_hlo.ptxas_path(str(tmp_path / "site"))
    assert stop.value.code == 2
    r = subprocess.run([sys.executable, "-m", "benchmarks.gpu_hlo", "--registers=dtn_(",
                        f"--site={tmp_path}"], cwd=REPO_ROOT, capture_output=True, text=True)
    assert r.returncode == 2 and "--registers='dtn_(' is not a regular expression" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    (tmp_path / "site" / "nvidia" / "cuda_nvcc" / "bin").mkdir(parents=True)
    plugin = tmp_path / "site" / "nvidia" / "cuda_nvcc" / "bin" / "ptxas"
    plugin.write_text("#!/bin/sh\n")
    plugin.chmod(0o755)
    assert gpu_hlo.ptxas_path(str(tmp_path / "site")) == str(plugin)
