"""What XLA:GPU makes of the train step, without a GPU: a deviceless compile for an H100/H200 and
a census of its kernels (how many, of which kind, the bytes each reads and writes, per model part).

    python -m benchmarks.gpu_hlo --model=S/16 --norm=layernorm,progressive --batch=256
    python -m benchmarks.gpu_hlo --model=B/16 --norm=layernorm,dtn --depth=2 --md=runs/hlo.md

A GPU is lent rarely and briefly; this answers on any CPU what a GPU run would execute: XLA compiles
the loop's train step (bfloat16, the GPU code paths: cuDNN attention, half-precision DTN moments)
for a described device (``jax.experimental.topologies``, XLA's deviceless compilation), and the
optimized HLO lists every kernel with its operands and results. Bytes are operands + results per
kernel (what it moves through memory if nothing stays in cache; an operand the kernel reads only
through slices counts the slices' elements); ``est ms`` is those bytes of the
memory-bound kernels (everything but matmuls and attention) at the device's bandwidth: a floor for
their time, not a measurement. Nothing here replaces ``gpu_table``: it says where to look, and
whether a change moves fewer bytes or launches fewer kernels, before a GPU measures it.

It needs jax's CUDA plugin for the installed jax, kept apart from the environment (installed, it
would make JAX try the GPU at every start):

    pip install --target .gpu_hlo_site "jax-cuda12-plugin[with-cuda]==$(python -c 'import jax; print(jax.__version__)')"

(about 5 GB; ``--site`` names another folder; the GPU host's jax 0.11 with CUDA 13 works the
same with ``jax-cuda13-plugin[with-cuda]``, Pallas norms included). The tool starts itself again
with that folder on its path and JAX on the CPU; the compile runs on the CPU (an S/16 step ~1
minute on 2 cores).
``--registers=REGEX`` adds, for the kernels so named (e.g. 'dtn_': DTN's Pallas kernels),
the registers and spilled bytes a thread that ``ptxas -v`` reports for sm_90a (the CUDA 12
plugin's compile writes PTX; 0.11's with CUDA 13 writes none).
``--depth`` compiles fewer blocks (per-block figures are the same; totals scale); ``--set``
changes the config of every compiled step (``--set=model.attention_impl='separate'``), so that
one formulation can be compared with another in a 40-second compile.

Memory comes from XLA's buffer assignment for the target: temporaries + arguments, what the step
holds on the device (within 0.1-0.3 GiB of the peak a GPU measured for the same step, which adds
cuBLAS/cuDNN workspaces). ``--peak=N`` lists the N largest groups of buffers live at that peak
(XLA's live-range report, written into a temporary dump), by what made them, blocks folded.
"""
from __future__ import annotations

import argparse
import ast
import collections
import contextlib
import dataclasses
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from typing import Any, Iterable, Iterator, Sequence

from benchmarks import files
from normvit_jax import tool_flags

TARGETS = {  # XLA's GpuDeviceInfo of the two cards this project is measured on (public specs)
    "h100": {"desc": "NVIDIA H100 80GB HBM3", "bandwidth": 3.35e12, "memory": 84_929_347_584},
    "h200": {"desc": "NVIDIA H200", "bandwidth": 4.8e12, "memory": 150_754_820_096},
}
_SPEC = """gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: {bandwidth:.0f} l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: {memory} shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: 9 }} registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 7 }}
runtime_version {{ major: 12 minor: 8 patch: 0 }}
device_description_str: "{desc}"
"""
_CHILD = "NORMVIT_GPU_HLO_CHILD"
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4,
          "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_ARRAY = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([0-9,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.+?) ([a-z][\w\-]*)\((.*)$")
_SKIP = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "after-all"}


@dataclasses.dataclass
class Kernel:
    """One launch of the optimized module's entry computation."""

    name: str
    kind: str  # matmul | attention | reduction/transpose | elementwise | custom fusion | copy | other
    bytes_in: int
    bytes_out: int
    part: str  # model part (block slot, or a top-level module), from the op_name metadata
    backward: bool
    block: int | None

    @property
    def bytes(self) -> int:
        return self.bytes_in + self.bytes_out

    @property
    def memory_bound(self) -> bool:
        return self.kind not in ("matmul", "attention")


def _arrays(shape: str) -> list[tuple[str, int]]:
    """(dtype, element count) of every array in an HLO shape string (tuples flattened)."""
    return [(dtype, math.prod(int(d) for d in dims.split(",") if d))
            for dtype, dims in _ARRAY.findall(shape)]


def array_bytes(shape: str) -> int:
    """Bytes of every array in an HLO shape string (tuples summed; layouts ignored)."""
    return sum(n * _BYTES[dtype] for dtype, n in _arrays(shape))


def _kind(op: str, line: str, name: str) -> str:
    if "cudnn" in line:
        return "attention"
    if "gemm" in name or "__cublas" in line or "gemm" in line.split("calls=")[-1][:40]:
        return "matmul"
    if op == "fusion":
        k = re.search(r"kind=(k\w+)", line)
        return {"kInput": "reduction/transpose", "kLoop": "elementwise",
                "kOutput": "matmul"}.get(k.group(1) if k else "", "custom fusion")
    return "copy" if op in ("copy", "transpose") else "other"


def _part(op_name: str | None) -> tuple[str, bool, int | None]:
    """(part, backward, block) of an op_name such as
    'jit(train_step)/transpose(jvp(ViT))/Transformer/encoderblock_5/encoderblock_5._block/LayerNorm_2/mul'."""
    if not op_name:
        return "(no op name)", False, None
    backward = "transpose(" in op_name
    segs = [s for s in op_name.split("/") if "(" not in s and ")" not in s]
    block = None
    rest = []
    for s in segs[:-1]:  # the last segment is the primitive
        m = re.fullmatch(r"encoderblock_(\d+)(\._block)?", s)
        if m:
            block = int(m.group(1))
            rest = []
            continue
        rest.append(s)
    if block is not None:
        return (rest[0] if rest else "(block: residual adds)"), backward, block
    if rest and rest[0] == "Transformer" and len(rest) > 1:
        return rest[1], backward, None
    return (rest[0] if rest else "(step: loss, optimizer)"), backward, None


def _computations(hlo_text: str) -> dict[str, list[str]]:
    """Every computation's instruction lines, by name."""
    out: dict[str, list[str]] = {}
    current = None
    for line in hlo_text.split("\n"):
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if head and not line.startswith(" "):
            current = out.setdefault(head.group(1), [])
        elif line.startswith("}"):
            current = None
        elif current is not None:
            current.append(line)
    return out


def _elements(shape: str) -> int:
    return sum(n for _, n in _arrays(shape))


_ONE_TO_ONE = ("bitcast", "convert", "reshape", "copy")  # an element in, an element out


def _sliced_parameters(lines: list[str]) -> dict[int, int]:
    """{parameter number: bytes read} for a fused computation's parameters that it reads only
    through slices (through bitcasts, converts, reshapes and copies on the way): a kernel that
    slices each row's first element reads those elements, not the whole operand."""
    defs, users = {}, {}
    for line in lines:
        m = _INSTR.match(line)
        if not m:
            continue
        name, shape, op, rest = m.groups()
        defs[name] = (shape, op, rest)
        for o in set(re.findall(r"%([\w.\-]+)", rest.split("), ")[0])):
            users.setdefault(o, []).append(name)

    def read(name: str) -> int | None:  # elements read through slices; None if read otherwise
        if not users.get(name):  # an output of the kernel: written whole
            return None
        total = 0
        for u in users[name]:
            shape, op, _ = defs[u]
            sub = (_elements(shape) if op in ("slice", "dynamic-slice")
                   else read(u) if op in _ONE_TO_ONE else None)
            if sub is None:
                return None
            total += sub
        return total

    out = {}
    for name, (shape, op, rest) in defs.items():
        if op == "parameter":
            got = read(name)
            if got is not None:
                size = array_bytes(shape) // max(_elements(shape), 1)
                out[int(rest.split(")")[0])] = got * size
    return out


def census(hlo_text: str) -> list[Kernel]:
    """The kernels of the ENTRY computation of an optimized HLO module's text; an operand that
    a fusion only slices counts the slices' bytes."""
    start = hlo_text.index("\nENTRY")
    body = hlo_text[hlo_text.index("{", start) + 1:]
    body = body[:body.index("\n}")]
    computations = _computations(hlo_text)
    shapes: dict[str, str] = {}
    out = []
    for line in body.split("\n"):
        m = _INSTR.match(line)
        if not m:
            continue
        name, shape, op, rest = m.groups()
        shapes[name] = shape
        if op in _SKIP:
            continue
        args = rest.split("), ")[0]
        operands = re.findall(r"%([\w.\-]+)", args)
        called = re.search(r"calls=%([\w.\-]+)", line)
        sliced = (_sliced_parameters(computations.get(called.group(1), []))
                  if op == "fusion" and called else {})
        b_in = sum(sliced.get(i, array_bytes(shapes[o])) for i, o in enumerate(operands)
                   if o in shapes)
        meta = re.search(r'op_name="([^"]+)"', line)
        part, backward, block = _part(meta.group(1) if meta else None)
        out.append(Kernel(name, _kind(op, line, name), b_in, array_bytes(shape), part, backward,
                          block))
    return out


def summarize(kernels: Iterable[Kernel], bandwidth: float) -> dict[str, Any]:
    """Totals, by kind, and per block part (summed over the blocks, divided by their number)."""
    kernels = list(kernels)
    by_kind: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for k in kernels:
        by_kind[k.kind][0] += 1
        by_kind[k.kind][1] += k.bytes
    blocks = sorted({k.block for k in kernels if k.block is not None})
    n = max(len(blocks), 1)
    per_part: dict[str, dict[str, float]] = {}
    for k in kernels:
        if k.block is None:
            continue
        key = ("backward " if k.backward else "forward ") + k.part
        d = per_part.setdefault(key, {"kernels": 0.0, "mem_bound_mb": 0.0, "all_mb": 0.0})
        d["kernels"] += 1 / n
        d["all_mb"] += k.bytes / n / 1e6
        d["mem_bound_mb"] += k.bytes / n / 1e6 if k.memory_bound else 0.0
    mb = sum(k.bytes for k in kernels if k.memory_bound)
    return {"kernels": len(kernels), "blocks": len(blocks),
            "mem_bound_gb": mb / 1e9, "mem_bound_est_ms": mb / bandwidth * 1e3,
            "by_kind": {k: {"kernels": int(v[0]), "gb": v[1] / 1e9} for k, v in by_kind.items()},
            "per_block_part": per_part}


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = tool_flags.Parser("python -m benchmarks.gpu_hlo", __doc__)
    p.add_argument("--model", default="S/16", help="model preset (S/16, B/16, ...)")
    p.add_argument("--norm", default="layernorm",
                   help="comma list of benchmarks.common.NORMS names; the first is the baseline")
    p.add_argument("--batch", type=tool_flags.positive_int, default=256, help="global batch")
    p.add_argument("--image_size", type=tool_flags.positive_int, default=224,
                   help="input resolution (default: 32 for a patch of at most 8, else 224)")
    p.add_argument("--depth", type=tool_flags.positive_int, default=None,
                   help="blocks to compile (default: the preset's)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for every norm's step (repeatable), e.g. "
                   "--set=model.attention_impl='separate' (VALUE a Python literal)")
    p.add_argument("--target", default="h100", choices=sorted(TARGETS),
                   help="the GPU compiled for (its bandwidth and memory, public specs)")
    p.add_argument("--site", default=".gpu_hlo_site",
                   help="folder holding jax's CUDA plugin (pip install --target, see above)")
    p.add_argument("--hlo_dir", default=None, help="also write each optimized HLO module here")
    p.add_argument("--peak", type=int, default=0, metavar="N",
                   help="also list the N largest groups of buffers live at the step's memory peak "
                   "(XLA's buffer assignment, blocks folded together)")
    p.add_argument("--registers", default=None, metavar="REGEX",
                   help="also report registers and spills a thread (ptxas -v for sm_90a, the "
                   "plugin's own ptxas) of each kernel whose name matches REGEX, e.g. 'dtn_' for "
                   "DTN's Pallas kernels (needs a plugin whose compile writes PTX: CUDA 12's)")
    p.add_argument("--json", default=None, help="write the census here")
    p.add_argument("--md", default=None, help="write the markdown tables here")
    args = p.parse_args(argv)
    if args.registers is not None:
        try:
            re.compile(args.registers)
        except re.error as e:
            p.error(f"--registers={args.registers!r} is not a regular expression ({e}); "
                    "accepted: e.g. 'dtn_'")
    return args


def overrides(items: Sequence[str]) -> list[tuple[str, Any]]:
    """``KEY=VALUE`` strings as (key, Python literal); a bad one exits 2 naming it."""
    out = []
    for item in items:
        key, sep, text = item.partition("=")
        try:
            if not sep or not key:
                raise ValueError
            out.append((key, ast.literal_eval(text)))
        except (ValueError, SyntaxError):
            raise ValueError(f"--set={item!r} is not KEY=VALUE with VALUE a Python literal "
                             "(e.g. --set=model.attention_impl='separate')") from None
    return out


def _plugin_missing(site: str) -> str | None:
    if not os.path.isdir(os.path.join(site, "jax_plugins")):
        import jax
        return (f"--site={site!r} holds no jax CUDA plugin; install it there: pip install --target "
                f"{site} \"jax-cuda12-plugin[with-cuda]=={jax.__version__}\" (about 5 GB)")
    return None


@contextlib.contextmanager
def _pallas_sees(target: str) -> Iterator[None]:
    """Pallas's Triton lowering (a Pallas norm, e.g. DTN's kernel='pallas') asks the local GPU
    for its compute capability: jax 0.10 assumed 9.0 without one, jax 0.11 refuses. Under
    jax 0.11 it is told the described card for the lowering (a private hook, restored after;
    where it is absent nothing changes)."""
    try:
        from jax._src.pallas.triton import gpu_info
        version = gpu_info.GpuVersion.H200 if target == "h200" else gpu_info.GpuVersion.H100
        info = gpu_info.get_gpu_info_from_version(version)
        real = gpu_info.get_gpu_info
    except (ImportError, AttributeError):
        yield
        return
    gpu_info.get_gpu_info = lambda: info
    try:
        yield
    finally:
        gpu_info.get_gpu_info = real


def compile_census(args: argparse.Namespace, norm: str) -> dict[str, Any]:
    """In the child: the deviceless GPU compile of ``norm``'s train step and its census."""
    import jax
    from jax.experimental import topologies

    target = TARGETS[args.target]
    topo = topologies.get_topology_desc(platform="cuda", topology="1x1x1",
                                        target_config=_SPEC.format(**target))
    from benchmarks import common
    from normvit_jax import sharding

    make_mesh = sharding.make_mesh
    real_backend = jax.default_backend
    # The model picks its GPU code paths from jax.default_backend(); the mesh is the described GPU.
    jax.default_backend = lambda: "gpu"
    sharding.make_mesh = lambda config=None, devices=None: make_mesh(config,
                                                                     devices=list(topo.devices))
    try:
        cfg = common.bench_config(args.model, norm, image_size=args.image_size, batch=args.batch,
                                  dtype="bfloat16", num_classes=1000, depth=args.depth)
        for key, value in overrides(args.set):
            *path, last = key.split(".")
            node = cfg
            for part in path:
                node = node[part]
            node[last] = value
        with _pallas_sees(args.target):
            lowered, _ = common.lower_abstract_train_step(cfg, 1000)
        with tempfile.TemporaryDirectory(prefix="gpu_hlo_") as dump:
            # XLA writes its buffers' live ranges and the kernels' PTX only into a dump
            dumped = bool(args.peak or args.registers)
            compiled = lowered.compile(compiler_options=dump_options(dump) if dumped else None)
            text = compiled.as_text()
            peak = peak_groups(live_range_text(dump), text)[:args.peak] if args.peak else None
            regs = (kernel_registers(dump, args.registers, ptxas_path(args.site))
                    if args.registers else None)
    finally:
        jax.default_backend, sharding.make_mesh = real_backend, make_mesh
    if args.hlo_dir:
        os.makedirs(args.hlo_dir, exist_ok=True)
        with open(os.path.join(args.hlo_dir, f"{norm}.hlo.txt"), "w") as f:
            f.write(text)
    return {**summarize(census(text), target["bandwidth"]), "memory": common.memory_stats(compiled),
            "peak": peak, "registers": regs}


def dump_options(folder: str) -> dict[str, str]:
    """XLA debug options that write the optimized module's buffer assignment into ``folder``."""
    return {"xla_dump_to": folder, "xla_dump_hlo_pass_re": "NONE"}


_PTXAS_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_PTXAS_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")


def ptxas_usage(text: str) -> dict[str, dict[str, int]]:
    """Per entry function of ``ptxas -v``'s report: registers a thread and spilled bytes."""
    out: dict[str, dict[str, int]] = {}
    entry = None
    for line in text.splitlines():
        if m := _PTXAS_ENTRY.search(line):
            entry = m.group(1)
            out[entry] = {"registers": 0, "spill_stores": 0, "spill_loads": 0}
        elif entry and (m := _PTXAS_SPILL.search(line)):
            out[entry].update(spill_stores=int(m.group(1)), spill_loads=int(m.group(2)))
        elif entry and (m := _PTXAS_REGS.search(line)):
            out[entry]["registers"] = int(m.group(1))
    return out


def ptxas_path(site: str) -> str:
    """The CUDA plugin's own ptxas (its nvcc wheel), else one on PATH; exits naming both."""
    here = os.path.join(site, "nvidia", "cuda_nvcc", "bin", "ptxas")
    found = here if os.access(here, os.X_OK) else shutil.which("ptxas")
    if not found:
        print(f"gpu_hlo: --registers needs ptxas: none in {here} or on PATH", file=sys.stderr)
        raise SystemExit(2)
    return found


def kernel_registers(dump: str, pattern: str, ptxas: str) -> list[dict[str, Any]]:
    """Registers and spills of the dump's kernels whose entry name matches ``pattern``: each PTX
    file holding one goes through ``ptxas -v`` for sm_90a (Hopper: the H100/H200 described)."""
    name = re.compile(pattern)
    rows = []
    for file in sorted(f for f in os.listdir(dump) if f.endswith(".ptx")):
        path = os.path.join(dump, file)
        with open(path) as f:
            entries = re.findall(r"\.entry\s+([\w$]+)", f.read())
        if not any(name.search(e) for e in entries):
            continue
        report = subprocess.run([ptxas, "-v", "-arch=sm_90a", path, "-o", os.devnull],
                                capture_output=True, text=True)
        for entry, usage in ptxas_usage(report.stdout + report.stderr).items():
            if name.search(entry):
                rows.append({"kernel": entry, **usage})
    if not rows:
        raise SystemExit(f"gpu_hlo: --registers={pattern!r}: no PTX kernel of that name in the "
                         "dump (jax 0.11's deviceless compile writes no PTX: use CUDA 12's plugin)")
    return sorted({r["kernel"]: r for r in rows}.values(), key=lambda r: r["kernel"])


def live_range_text(dump: str) -> str:
    """The train step's live-range report from an XLA dump folder."""
    names = [n for n in os.listdir(dump) if n.endswith("live-range.txt") and "train_step" in n]
    if not names:
        raise SystemExit(f"gpu_hlo: XLA wrote no live-range file into {dump}")
    with open(os.path.join(dump, sorted(names)[-1])) as f:
        return f.read()


def peak_groups(live_range: str, hlo_text: str) -> list[dict[str, Any]]:
    """The buffers live at the peak of XLA's live-range report, grouped by what made them: the
    step's state by its tree path, every other buffer by direction, model part and primitive,
    blocks folded together. Largest first: [{'what', 'buffers', 'bytes'}]."""
    lines = live_range.splitlines()
    start = next(i for i, line in enumerate(lines) if "(peak):" in line)
    op_names = {}
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        meta = re.search(r'op_name="([^"]+)"', line) if m else None
        if meta:
            op_names[m.group(1)] = meta.group(1)
    groups: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for line in lines[start + 1:]:
        m = re.match(r"\s+([\w.\-]+)(?:\{[\d,]*\})?: (\d+) bytes", line)
        if not m:
            break
        group = groups[_buffer_group(op_names.get(m.group(1)))]
        group[0] += 1
        group[1] += int(m.group(2))
    return [{"what": k, "buffers": v[0], "bytes": v[1]}
            for k, v in sorted(groups.items(), key=lambda kv: -kv[1][1])]


def _buffer_group(op_name: str | None) -> str:
    if op_name and op_name.startswith("state."):
        return re.sub(r"\[.*", "", op_name.replace("state.opt_state", "optimizer state")
                      .replace("state.params", "parameters"))
    if op_name and op_name.startswith("batch"):
        return "batch"
    part, backward, block = _part(op_name)
    prim = op_name.rsplit("/", 1)[-1] if op_name else ""
    where = f"{'backward' if backward else 'forward'} {part}"
    return f"{where}{', all blocks' if block is not None else ''}: {prim}"


def markdown(results: dict[str, Any], args: argparse.Namespace) -> str:
    norms = list(results)
    base = norms[0]
    t = TARGETS[args.target]
    lines = [f"Deviceless XLA:GPU compile for an {t['desc']} ({t['bandwidth'] / 1e12:.2f} TB/s): "
             f"{args.model}, batch {args.batch}, bfloat16, {results[base]['blocks']} blocks. "
             "Bytes: operands (only their slices where a kernel slices them) + results of each "
             "kernel; est ms: the memory-bound kernels' bytes at the bandwidth (a floor, not a "
             "measurement). Memory: XLA's buffer assignment, "
             "temporaries + arguments (the state and the batch), what the step holds on the device "
             "(a measured peak adds the GPU libraries' workspaces).", "",
             "| norm | kernels | memory-bound GB | est ms | matmul GB | attention GB | memory GiB |",
             "|---|---|---|---|---|---|---|"]
    for n in norms:
        r = results[n]
        kind = lambda k: r["by_kind"].get(k, {"gb": 0.0})["gb"]  # noqa: E731
        mem = r.get("memory")
        held = "-" if not mem else f"{(mem['temp'] + mem['arguments']) / 2**30:.2f}"
        lines.append(f"| {n} | {r['kernels']} | {r['mem_bound_gb']:.2f} | "
                     f"{r['mem_bound_est_ms']:.2f} | {kind('matmul'):.2f} | {kind('attention'):.2f} "
                     f"| {held} |")
    parts = sorted({p for n in norms for p in results[n]["per_block_part"]})
    lines += ["", "Per block (average over blocks): kernels / memory-bound MB",
              "", "| part | " + " | ".join(norms) + " |", "|---|" + "---|" * len(norms)]
    for p in parts:
        cells = []
        for n in norms:
            d = results[n]["per_block_part"].get(p)
            cells.append("-" if d is None else f"{d['kernels']:.0f} / {d['mem_bound_mb']:.0f}")
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    if any(results[n].get("registers") for n in norms):
        lines += ["", "Registers and spilled bytes a thread (`ptxas -v`, sm_90a)", "",
                  "| norm | kernel | registers | spill stores B | spill loads B |",
                  "|---|---|---|---|---|"]
        lines += [f"| {n} | {r['kernel']} | {r['registers']} | {r['spill_stores']} | "
                  f"{r['spill_loads']} |" for n in norms for r in results[n].get("registers") or []]
    for n in norms:
        if results[n].get("peak"):
            lines += ["", f"{n}: the largest buffers live at the memory peak", "",
                      "| what | buffers | GiB |", "|---|---|---|"]
            lines += [f"| {g['what']} | {g['buffers']} | {g['bytes'] / 2**30:.2f} |"
                      for g in results[n]["peak"]]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    from benchmarks import common
    with common.tool_errors("python -m benchmarks.gpu_hlo"):  # a SystemExit('text'): exit 2
        norms = common.norm_names(args.norm)
    if os.environ.get(_CHILD) != "1":
        try:
            overrides(args.set)  # a bad --set exits 2 before anything starts
        except ValueError as e:
            print(f"gpu_hlo: {e}", file=sys.stderr)
            return 2
        problem = _plugin_missing(args.site)
        if problem:
            print(f"gpu_hlo: {problem}", file=sys.stderr)
            return 2
        if args.registers:
            ptxas_path(args.site)  # no ptxas: exits 2 before the compile
        env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [os.path.abspath(args.site), os.getcwd(),
                                                            os.environ.get("PYTHONPATH")])))
        env[_CHILD] = "1"
        cmd = [sys.executable, "-m", "benchmarks.gpu_hlo", *(sys.argv[1:] if argv is None else argv)]
        return subprocess.call(cmd, env=env)
    results = {}
    for n in norms:
        print(f"gpu_hlo: compiling {args.model} {n} for {args.target} ...", flush=True)
        results[n] = compile_census(args, n)
        r = results[n]
        print(f"gpu_hlo: {n}: {r['kernels']} kernels, memory-bound {r['mem_bound_gb']:.2f} GB "
              f"(~{r['mem_bound_est_ms']:.2f} ms at {args.target}'s bandwidth)", flush=True)
    md = markdown(results, args)
    print(md)
    if args.md:
        files.write_text_atomic(args.md, md)
    if args.json:
        common.write_json(args.json, {"args": vars(args), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
