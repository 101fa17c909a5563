"""The same numbers on any core count of a CPU model (``config.reproducible_cpu_threads``; the
demos set 2). Not across CPU models: see the end of this docstring.

XLA:CPU's defaults make a float32 result depend on the machine, and a training run amplifies the
last-bit differences until the final top-1 differs by a percent or two (issue 35, measured on the
digits demo: 96.34% on a 2-core AVX2 EPYC, 97.46% on a 2-core AVX-512 one, 98.03% in the table
that was written on a third). Three causes, each seen by hashing the state after a train step:
1. the number of cores: XLA's intra-op thread pool has one thread per core, and both Eigen (the
   weight gradients' long contractions) and YNNPACK (reductions) split work across it, summing
   partial results in another order (the same step on 1 and 2 cores gave other bits);
2. the vector ISA of the generated code: XLA compiles fused loops for the host CPU (AVX-512 where
   present; other bits with ``xla_cpu_max_isa=AVX`` than AVX2 on the same machine);
3. library kernels chosen at run time by the CPU's features (YNNPACK's dot and reduction kernels).
Set before JAX starts its CPU backend, this pins all three: ``PJRT_NPROC`` fixes the thread pool
at N threads whatever the core count (N threads on fewer cores take turns; on more cores the run
uses N), ``xla_cpu_max_isa=AVX2`` caps the generated code at AVX2 (the ISA every CPU this demo
was measured on has), YNNPACK fusions are off (dots run in the Eigen kernels built into jaxlib,
which do not dispatch on the CPU; faster on shared cores too: benchmarks/xla_flags.py's 'tuned'
preset, whose barrier flag comes with it), and platform-dependent math is off. GPU and TPU
backends ignore all of it. Off (0) by default: a large CPU run wants every core.

main.py applies it before anything runs; ``train.loop.train_and_evaluate`` (the library entry
point) applies it too when JAX's backend has not started yet, and otherwise, unless the pinning is
in effect already (``in_effect``: main.py's, or an earlier call's), logs ``too_late``'s warning and
trains unpinned.

What it does not pin (2026-11-27): with all of the above, the same code (26d2750) printed 96.34%
for the LayerNorm demo on a 2-core AVX2 EPYC and 98.31% on a 2-core AVX-512/AMX Xeon. On the Xeon
the result was the same bits on 1 and 2 cores, with single-threaded Eigen, with XNNPACK off
(``xla_cpu_use_xnnpack``) and with numpy and OpenBLAS held to AVX2 (``NPY_DISABLE_CPU_FEATURES``,
``OPENBLAS_CORETYPE``), so none of those is the difference. What is left varies with the CPU model, not the core count: Eigen's
matrix-product blocking, which it sizes from the CPU's cache sizes at run time (the order of a
long contraction's partial sums), is the likely cause; no flag sets it. README's demo table
therefore gives each method's range over seeds and CPU models.
"""
from __future__ import annotations

import os
import sys

FLAGS = {
    "xla_cpu_max_isa": "AVX2",
    "xla_cpu_experimental_ynn_fusion_type": "",
    "xla_cpu_enable_platform_dependent_math": "false",
    # with YNNPACK off, keeping the model's fusion barriers avoids recomputing the residual
    # gradient per block (benchmarks/xla_flags.py measured a 4.7x slower step without)
    "xla_disable_hlo_passes": "cse_barrier_expander",
}
THREADS_ENV = "PJRT_NPROC"


def backend_started() -> bool:
    """Whether JAX has created a backend (then XLA_FLAGS and PJRT_NPROC are read already)."""
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge
        return bool(getattr(xla_bridge, "_backends", {}))
    except Exception:  # noqa: BLE001  (a private API moved: assume the worst)
        return True


def apply(threads: int, environ: dict | None = None) -> str | None:
    """Pins XLA:CPU's numerics for ``threads`` > 0 (see the module docstring); returns the line to
    log, or None when off. A flag or PJRT_NPROC the user set already is kept (the user's choice
    wins, and the line says so). Raises RuntimeError if JAX's backend has started."""
    if not threads:
        return None
    if backend_started():
        raise RuntimeError("config.reproducible_cpu_threads must be applied before JAX starts "
                           "its backend (main.py does it before anything runs)")
    env = os.environ if environ is None else environ
    parts = env.get("XLA_FLAGS", "").split()
    kept = []
    for key, value in FLAGS.items():
        if any(p.startswith(f"--{key}=") for p in parts):
            kept.append(key)
        else:
            parts.append(f"--{key}={value}")
    env["XLA_FLAGS"] = " ".join(parts)
    if THREADS_ENV in env:
        kept.append(f"{THREADS_ENV}={env[THREADS_ENV]}")
    else:
        env[THREADS_ENV] = str(int(threads))
    return (f"Reproducible CPU numerics (config.reproducible_cpu_threads={threads}): XLA:CPU on "
            f"{env[THREADS_ENV]} threads, AVX2 code, no YNNPACK: the same numbers on any core count "
            "of this CPU model (other models may differ in the last bits)"
            + (f"; kept your own {', '.join(kept)}" if kept else "") + ".")


def in_effect(environ: dict | None = None) -> bool:
    """Whether the environment holds the pinning: PJRT_NPROC set and every flag of ``FLAGS`` in
    XLA_FLAGS (``apply``'s, main.py's, or the user's own before JAX started)."""
    env = os.environ if environ is None else environ
    parts = env.get("XLA_FLAGS", "").split()
    return THREADS_ENV in env and all(any(p.startswith(f"--{key}=") for p in parts)
                                      for key in FLAGS)


def too_late(threads: int) -> str:
    """The warning of a library call (``train_and_evaluate``) made after JAX started its CPU
    backend without the pinning: what it means and what to do."""
    return (f"config.reproducible_cpu_threads={threads} is not applied: JAX started its CPU "
            "backend in this process before train_and_evaluate was called (XLA reads its flags "
            "and thread count once), so this run trains with XLA's default CPU numerics, whose "
            "last bits differ from main.py's (which pins them), also when main.py later resumes "
            f"this run. To pin them, call normvit_jax.reproducible.apply({threads}) or "
            "train_and_evaluate first in a new process (before anything uses JAX), or set "
            "config.reproducible_cpu_threads=0 to record the run as not pinned.")
