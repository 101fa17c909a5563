"""XLA flags for the benchmarks, set before JAX initialises its backend.

Import this module, and call ``apply()``, before anything imports jax: XLA reads ``XLA_FLAGS``
once, when the first backend starts. The same flags are also passed to every compile the harness
does itself (``compiler_options``), so they hold even when JAX was started earlier (under pytest).

Presets (``--xla_preset``), measured on a 2-core AVX-512 Xeon shared with other jobs, ViT-Ti/4
train step at batch 128 (docs/benchmarks.md):
  tuned    ``xla_cpu_experimental_ynn_fusion_type=''``: dots and their neighbours run in XLA's
           own Eigen kernels instead of YNNPACK fusions, which slowed down 2-4x whenever the
           cores were shared (and were at best on par when idle);
           ``xla_disable_hlo_passes=cse_barrier_expander``: keeps ``lax.optimization_barrier``
           until fusion, so the model's fusion barriers (``model.fusion_barriers``) work: without
           them the Eigen path recomputes the residual gradient per block (a 4.7x slower step).
           The two go together: YNNPACK off without the barriers is the slowest setting of all.
  default  XLA's own defaults, for comparison.
Flags that measured no gain here (so are not set): a 512-bit vector width; disabling the tree
reduction rewriter (1.9x slower); see docs/benchmarks.md for the rest.
The presets are CPU settings: where a GPU/TPU plugin is installed (and ``JAX_PLATFORMS`` does not
say cpu) none of their flags is set, since there a kept ``optimization_barrier`` (what
``jax.checkpoint`` emits) fails to compile ("Unsupported instruction opcode: opt-barrier",
seen on an H200 with jax 0.11.2) and the benchmarks must measure what main.py runs.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from typing import Sequence

PRESETS: dict[str, dict[str, str]] = {
    "tuned": {"xla_cpu_experimental_ynn_fusion_type": "",
              "xla_disable_hlo_passes": "cse_barrier_expander"},
    "default": {},
}
_LIST_FLAGS = ("xla_disable_hlo_passes",)  # comma lists: merged with a user's value
DEFAULT_PRESET = "tuned"
_applied: dict[str, object] = {}


def preset_from_argv(argv: Sequence[str] | None = None) -> str:
    argv = sys.argv[1:] if argv is None else argv
    for i, a in enumerate(argv):
        if a.startswith("--xla_preset="):
            return a.split("=", 1)[1]
        if a == "--xla_preset" and i + 1 < len(argv):
            return argv[i + 1]
    return DEFAULT_PRESET


_ACCELERATOR_PLUGINS = ("jax_cuda13_plugin", "jax_cuda12_plugin", "jax_rocm7_plugin",
                        "jax_rocm60_plugin", "libtpu")


def accelerator_expected() -> bool:
    """Whether JAX will start on a GPU/TPU: its plugin is installed and JAX_PLATFORMS allows it
    (decided before JAX starts, from what is installed)."""
    platforms = os.environ.get("JAX_PLATFORMS", "").strip().lower()
    if platforms and set(platforms.split(",")) <= {"cpu"}:
        return False
    return any(importlib.util.find_spec(n) is not None for n in _ACCELERATOR_PLUGINS)


def backend_started() -> bool:
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge
        return bool(getattr(xla_bridge, "_backends", {}))
    except Exception:  # private API moved: assume the worst
        return True


def apply(preset: str | None = None, argv: Sequence[str] | None = None) -> dict[str, object]:
    """Adds the preset's flags to ``XLA_FLAGS`` (flags the user set there win). Returns a record
    of what was done, printed by the entry points. An unknown preset on the command line is left
    to the entry point's parser (its one-line error and exit 2; this ran at import, exit 1)."""
    if preset is None:
        preset = preset_from_argv(argv)
        if preset not in PRESETS:
            preset = DEFAULT_PRESET
    if preset not in PRESETS:
        raise SystemExit(f"--xla_preset={preset!r} is not known; accepted: {sorted(PRESETS)}")
    flags = {} if accelerator_expected() else PRESETS[preset]
    existing = os.environ.get("XLA_FLAGS", "")
    parts = existing.split()
    for k, v in flags.items():
        same = [i for i, p in enumerate(parts) if p.startswith(f"--{k}=")]
        if not same:
            parts.append(f"--{k}={v}")
        elif k in _LIST_FLAGS and v not in parts[same[-1]].split("=", 1)[1].split(","):
            parts[same[-1]] += f",{v}"
    started = backend_started()
    if not started:
        os.environ["XLA_FLAGS"] = " ".join(parts)
    _applied.clear()
    _applied.update(preset=preset, flags=dict(flags), env_applied=not started,
                    XLA_FLAGS=os.environ.get("XLA_FLAGS", ""))
    return dict(_applied)


def compiler_options() -> dict[str, str]:
    """The preset's flags as per-compile options, for when they could not go into XLA_FLAGS in
    time (JAX started first, e.g. under pytest); empty when XLA_FLAGS carries them already."""
    if _applied.get("env_applied") or accelerator_expected():
        return {}
    return dict(_applied.get("flags", PRESETS[DEFAULT_PRESET]))  # type: ignore[arg-type]


def describe() -> str:
    if not _applied:
        return "xla preset: not applied"
    flags = " ".join(f"--{k}={v}" for k, v in _applied["flags"].items()) or "(none)"  # type: ignore[union-attr]
    how = "XLA_FLAGS + compiler_options" if _applied["env_applied"] else "compiler_options only"
    return f"xla preset: {_applied['preset']} [{flags}] via {how}"


def flag_options(flags: str) -> dict[str, object]:
    """``'--xla_a=true --xla_b=4'`` as per-compile options ``{'xla_a': True, 'xla_b': '4'}``: XLA
    takes debug options by name at compile time (a bool field needs a Python bool; other values
    parse from their text). An unknown name fails that compile ('No such compile option')."""
    out: dict[str, object] = {}
    for part in flags.split():
        if not part.startswith("--") or "=" not in part:
            raise SystemExit(f"XLA flag {part!r}: expected --name=value")
        k, v = part[2:].split("=", 1)
        out[k] = {"true": True, "false": False}.get(v.lower(), v)
    return out


def parse_variants(spec: str, flag: str = "variants") -> list[tuple[str, str]]:
    """``'base=;lhs=--xla_gpu_enable_latency_hiding_scheduler=true'`` -> [(name, flags)], in order;
    an empty flag string is the run as it is (no variant). ``flag``: the option's name in errors."""
    out = []
    for item in (s.strip() for s in spec.split(";")):
        if not item:
            continue
        name, sep, flags = item.partition("=")
        if not sep or not name.strip().isidentifier():
            raise SystemExit(f"--{flag}: {item!r} is not NAME=FLAGS (NAME a word)")
        flag_options(flags)  # fail early on a malformed flag
        out.append((name.strip(), flags.strip()))
    if len({n for n, _ in out}) != len(out):
        raise SystemExit(f"--{flag}: names repeat in {spec!r}")
    return out
