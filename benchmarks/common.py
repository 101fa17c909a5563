"""Shared pieces of the benchmark entry points: configs, compiled steps, timing, reports.

Import ``benchmarks.xla_flags`` and call ``apply()`` before importing this module (it imports jax).
Timing rules: every timed call ends with ``jax.block_until_ready``; several variants are timed
interleaved in one process (round-robin, the order rotated every round) and compared as per-round
ratios, because a shared machine's speed drifts between and within runs.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from benchmarks import files, xla_flags
from configs import default
from normvit_jax import cli, data, models, norms, sharding, tool_flags
from normvit_jax.train import optimizer as optim
from normvit_jax.train import setup
from normvit_jax.train.state import TrainState

ATTENTION_IMPLS = list(models.spec.ATTENTION_IMPLS)  # --attention_impl choices

# Every normalizer of the registry (+ DPN, a patch norm), each in every norm slot of the model:
# the norm's own cost, not a method's layout. name -> model config changes.
NORMS: dict[str, dict[str, Any]] = {
    "layernorm": {},
    "rmsnorm": {"norm": {"name": "rmsnorm"}},
    "scalenorm": {"norm": {"name": "scalenorm"}},
    "groupnorm": {"norm": {"name": "groupnorm"}},
    "instancenorm": {"norm": {"name": "instancenorm"}},
    "batchnorm": {"norm": {"name": "batchnorm"}},
    "powernorm": {"norm": {"name": "powernorm"}},
    "unified": {"norm": {"name": "unified"}},
    "dtn": {"norm": {"name": "dtn"}},
    "dtn_var": {"norm": {"name": "dtn_var"}},
    # DTN in Pallas kernels (norms/dtn_pallas.py), half-precision moments also for float32 runs
    "dtn_pallas": {"norm": {"name": "dtn", "kernel": "pallas", "moments_dtype": "bfloat16"}},
    "learnable_scaler": {"norm": {"name": "learnable_scaler"}},
    "rescale": {"norm": {"name": "rescale"}, "residual_scaling": "rescale", "final_norm": False},
    "identity": {"norm": {"name": "identity"}},
    "dpn": {"patch_norm": "dual"},
    # Issue 26: train with statistics / point-wise functions, fold at inference.
    "repbn": {"norm": {"name": "repbn"}},
    "progressive": {"norm": {"name": "progressive", "decay_steps": 1000}},  # LN -> RepBN
    "zscore_repbn": {"norm": {"name": "progressive", "n1": {"name": "zscore"},
                              "decay_steps": 1000}},  # the seed's dynamic feature norm
    "zscore": {"norm": {"name": "zscore"}},
    "minmax": {"norm": {"name": "minmax"}},
    "dyt": {"norm": {"name": "dyt"}},
    "derf": {"norm": {"name": "derf"}},
}
# A norm added to the registry is benchmarked with its default options without an entry above
# (--norm=NAME, and 'all'); an entry above is only for options or a model layout.
REGISTRY_ONLY = [n for n in norms.known_names() if n not in NORMS]
NORMS.update({n: {"norm": {"name": n}} for n in REGISTRY_ONLY})
DTYPES = setup.DTYPES


def norm_names(arg: str) -> list[str]:
    names = list(NORMS) if arg == "all" else [n.strip() for n in arg.split(",") if n.strip()]
    bad = [n for n in names if n not in NORMS]
    if bad:
        raise SystemExit(f"--norm: unknown {bad}; accepted: 'all' or a comma list of {list(NORMS)}")
    if len(names) > 1 and "layernorm" not in names:
        names.insert(0, "layernorm")  # ratios need the baseline in the same run
    return names


def check_norm(name: str, flag: str = "norm") -> str:
    """``name`` if it is one benchmark norm, else a ValueError naming ``--flag`` (exit 2 by
    tool_errors; it was a KeyError where the config is built)."""
    if name not in NORMS:
        raise ValueError(f"--{flag}: unknown {name!r}; accepted: one of {list(NORMS)}")
    return name


def default_image_size(model: str) -> int:
    """32 (CIFAR) for patch sizes up to 8, else 224 (ImageNet)."""
    size, _, patch = model.partition("/")
    if not patch.isdigit() or int(patch) < 1:  # 'Ti' was an IndexError before the preset's check
        raise ValueError(f"model {model!r} is not a known preset; accepted: '<size>/<patch>' "
                         f"with size in {sorted(models.spec.VARIANTS)} and an integer patch, "
                         "e.g. 'S/16'")
    return 32 if int(patch) <= 8 else 224


def depth_label(args: Mapping[str, Any]) -> str:
    """' depth=N' for a report's header where --depth overrode the preset's: without it a
    one-block run's table reads as the whole model's."""
    return f" depth={args['depth']}" if args.get("depth") else ""


def bench_config(model: str = "Ti/4", norm: str = "layernorm", *, image_size: int | None = None,
                 batch: int = 128, dtype: str = "float32", remat: bool = False, scan: bool = False,
                 grad_accum: int = 1, num_classes: int = 10, depth: int | None = None,
                 model_overrides: Mapping[str, Any] | None = None) -> ml_collections.ConfigDict:
    """The base config with ``model`` ('Ti/4', 'S/16', ...), one normalizer in every slot."""
    c = default.get_config()
    c.model.variant = model
    if depth is not None:
        c.model.depth = depth
    c.data.image_size = image_size or default_image_size(model)
    c.batch_size = batch
    c.dtype = dtype
    c.remat = remat
    c.model.scan = scan
    c.grad_accum_steps = grad_accum
    c.total_steps = 10_000
    c.data.name = "cifar10" if num_classes == 10 else "imagenet2012"
    for k, v in {**NORMS[norm], **(model_overrides or {})}.items():
        c.model[k] = ml_collections.ConfigDict(v) if isinstance(v, dict) else v
    return c


@dataclasses.dataclass
class TrainBench:
    """One compiled train step with its own state (donated and replaced at every call)."""

    name: str
    config: ml_collections.ConfigDict
    compiled: Any
    state: Any
    batch: dict[str, jax.Array]
    compile_s: float
    flops: float | None
    memory: dict[str, int]
    init_s: float = 0.0  # building the model and its initial state (the init program's compile)

    def step(self) -> float:
        """One step, synchronised; returns its wall time in seconds."""
        t = time.perf_counter()
        self.state, metrics = self.compiled(self.state, self.batch)
        jax.block_until_ready((self.state, metrics))
        return time.perf_counter() - t


def synthetic_batch(batch: int, image_size: int, num_classes: int, mesh: Any,
                    seed: int = 0) -> dict[str, jax.Array]:
    rng = np.random.default_rng(seed)
    host = {"image": rng.uniform(-1, 1, (batch, image_size, image_size, 3)).astype(np.float32),
            "label": rng.integers(0, num_classes, batch).astype(np.int32)}
    return sharding.to_global(host, mesh)


def cost_flops(compiled: Any) -> float | None:
    """FLOPs of one call from XLA's cost analysis of the compiled executable."""
    try:
        ca = compiled.cost_analysis()
    except Exception:  # some backends do not implement it
        return None
    if isinstance(ca, (list, tuple)):
        ca = ca[0] if ca else {}
    return float(ca["flops"]) if ca and "flops" in ca else None


def memory_stats(compiled: Any) -> dict[str, int]:
    """XLA's buffer assignment of the compiled executable (bytes) and, where the device reports
    it, the measured peak. 'xla_peak' is XLA's simulated peak (``peak_memory_in_bytes``), except
    on CPU: there (jaxlib 0.10) that figure is about the arguments alone, leaving out the
    temporaries, so it is arguments + outputs + temporaries - donated aliases (an upper bound)."""
    out: dict[str, int] = {}
    try:
        m = compiled.memory_analysis()
        out.update(arguments=int(m.argument_size_in_bytes), outputs=int(m.output_size_in_bytes),
                   temp=int(m.temp_size_in_bytes), alias=int(m.alias_size_in_bytes))
        peak = int(getattr(m, "peak_memory_in_bytes", 0) or 0)
        total = out["arguments"] + out["outputs"] + out["temp"] - out["alias"]
        out["xla_peak"] = total if jax.default_backend() == "cpu" or not peak else peak
    except Exception:
        pass
    return out


def device_peak_bytes() -> int | None:
    """Peak bytes in use reported by device 0 (GPU/TPU); None on CPU, which reports nothing."""
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def _train_parts(config: ml_collections.ConfigDict, num_classes: int) -> tuple[Any, Any, Any, Callable]:
    """(mesh, model, optimizer, train-step function) as the loop builds them from ``config``."""
    mesh = sharding.make_mesh(config)
    model = setup.create_model(config, num_classes)
    tx, lr = optim.create(config, int(config.total_steps))
    ds = dataclasses.replace(data.resolve_data_spec(config), num_classes=num_classes)
    return mesh, model, tx, setup.make_train_step(config, model, tx, lr, ds)


def lower_abstract_train_step(config: ml_collections.ConfigDict, num_classes: int = 10
                              ) -> tuple[Any, TrainState]:
    """(the loop's train step lowered for abstract inputs, the abstract state): nothing is
    allocated, for compile-time and memory measurements of any size."""
    mesh, model, tx, fn = _train_parts(config, num_classes)
    size, b = int(config.data.image_size), int(config.batch_size)
    state, state_sharding = setup.abstract_train_state(model, tx, (size, size, 3), mesh,
                                                       sharding.fsdp_min_size(config))
    bat = sharding.batch_sharding(mesh)
    batch = {"image": jax.ShapeDtypeStruct((b, size, size, 3), np.float32, sharding=bat),
             "label": jax.ShapeDtypeStruct((b,), np.int32, sharding=bat)}
    return setup.jit_train_step(fn, state_sharding, mesh).lower(state, batch), state


def compile_train(name: str, config: ml_collections.ConfigDict, *, num_classes: int = 10,
                  seed: int = 0, compiler_options: Mapping[str, Any] | None = None) -> TrainBench:
    """Builds the model, optimizer and state as the train loop does, and compiles the train step
    with the loop's shardings and donation (normvit_jax.train.setup), with the preset's flags
    and ``compiler_options`` (XLA debug options by name, e.g. an XLA GPU flag variant)."""
    t = time.perf_counter()
    mesh, model, tx, fn = _train_parts(config, num_classes)
    size = int(config.data.image_size)
    state, state_sharding = setup.create_train_state(model, tx, (size, size, 3), mesh,
                                                     jax.random.key(seed),
                                                     sharding.fsdp_min_size(config))
    batch = synthetic_batch(int(config.batch_size), size, num_classes, mesh, seed)
    jax.block_until_ready((state, batch))
    init_s = time.perf_counter() - t
    t = time.perf_counter()
    compiled = setup.jit_train_step(fn, state_sharding, mesh).lower(state, batch).compile(
        compiler_options={**xla_flags.compiler_options(), **(compiler_options or {})})
    compile_s = time.perf_counter() - t
    return TrainBench(name, config, compiled, state, batch, compile_s, cost_flops(compiled),
                      memory_stats(compiled), init_s)


def interleaved(runners: Mapping[str, Callable[[], float]], rounds: int,
                warmup: int = 1) -> dict[str, list[float]]:
    """Calls every runner once per round, round-robin, rotating the order each round so that no
    variant always runs first (after a pause) or last. ``warmup`` rounds are run and dropped."""
    names = list(runners)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(warmup + rounds):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            dt = runners[n]()
            if r >= warmup:
                times[n].append(dt)
    return times


@dataclasses.dataclass
class Summary:
    median: float
    lo: float  # 25th percentile
    hi: float  # 75th percentile
    n: int

    def fmt(self, scale: float = 1.0, digits: int = 3) -> str:
        return (f"{self.median * scale:.{digits}f} [{self.lo * scale:.{digits}f}, "
                f"{self.hi * scale:.{digits}f}]")


def summarize(xs: Sequence[float]) -> Summary:
    xs = sorted(xs)
    if not xs:
        return Summary(float("nan"), float("nan"), float("nan"), 0)
    q = lambda p: float(np.percentile(xs, p))
    return Summary(statistics.median(xs), q(25), q(75), len(xs))


def paired_ratios(times: Mapping[str, list[float]], base: str) -> dict[str, Summary]:
    """Per-round time / the baseline's time in the same round, summarised."""
    return {n: summarize([a / b for a, b in zip(ts, times[base])]) for n, ts in times.items()}


def matmul_probe(dtype: Any = jnp.float32, n: int = 2048, repeats: int = 5) -> float:
    """Best FLOP/s of an n x n x n matmul on device 0: a measured stand-in for the peak."""
    a = jnp.ones((n, n), dtype)
    f = jax.jit(lambda x, y: x @ y).lower(a, a).compile(
        compiler_options=xla_flags.compiler_options())
    jax.block_until_ready(f(a, a))
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(f(a, a))
        best = min(best, time.perf_counter() - t)
    return 2.0 * n ** 3 / best


def machine() -> dict[str, Any]:
    """Where and with what a result was measured (printed with every report)."""
    info: dict[str, Any] = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": platform.node(), "python": platform.python_version(),
        "cpu": _cpu_model(), "cores": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "devices": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
        "backend": jax.default_backend(),
    }
    for mod in ("jax", "jaxlib", "flax", "optax", "numpy", "torch", "timm"):
        m = sys.modules.get(mod)
        if m is None and mod in ("jax", "jaxlib", "flax", "optax", "numpy"):
            m = __import__(mod)
        if m is not None:
            info[mod] = getattr(m, "__version__", "?")
    info["xla"] = xla_flags.describe()
    return info


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def print_machine(info: Mapping[str, Any] | None = None) -> None:
    info = info or machine()
    print("# " + ", ".join(f"{k}={v}" for k, v in info.items()), flush=True)


def table(rows: Iterable[Mapping[str, Any]], columns: Sequence[str]) -> str:
    """A markdown table of the given columns (missing values as '-')."""
    rows = list(rows)
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(_cell(r.get(c)) for c in columns) + " |")
    return "\n".join(lines)


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.3e}"
    return str(v)


@contextlib.contextmanager
def tool_errors(prog: str) -> Iterator[None]:
    """The project's CLI contract for an entry point (docs/faults.md): a bad flag value or config
    (a ValueError, or a ``SystemExit('message')`` of a check here) is one line
    ``<prog>: error: <message>`` and exit 2, Ctrl-C one line and 130; a bug keeps its traceback.
    (A ``SystemExit`` with a text exits 1, the code of a bug, without this.)"""
    with cli.tool_errors(prog):
        try:
            yield
        except SystemExit as e:
            if not isinstance(e.code, str):
                raise
            print(f"{prog}: error: {e.code}", file=sys.stderr, flush=True)
            sys.exit(cli.EXIT_CONFIG)


def _prog(fn: Callable) -> str:
    """``python -m benchmarks.<name>`` of the module defining ``fn`` (also when run as __main__)."""
    spec = getattr(sys.modules.get(fn.__module__), "__spec__", None)
    return f"python -m {spec.name if spec else fn.__module__}"


def run_entry(parse: Callable, run: Callable, report: Callable,
              argv: Sequence[str] | None) -> dict[str, Any]:
    """An entry point's ``main``: parse, run, print the machine and the report, write the JSON;
    bad input is one line and exit 2 (``tool_errors``)."""
    with tool_errors(_prog(parse)):
        args = parse(argv)
        if args.json:  # before the work, not a traceback after it
            tool_flags.check_output("json", args.json)
        res = run(args)
        print_machine(res["machine"])
        print(report(res), flush=True)
        write_json(args.json, res)
    return res


def write_json(path: str | None, payload: Any) -> None:
    """Writes ``payload`` as JSON to ``path`` (if given) atomically: a reader, or a parent that
    stops this process mid-run, finds the previous complete file or the new one."""
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        files.write_text_atomic(path, json.dumps(
            payload, indent=1,
            default=lambda o: dataclasses.asdict(o) if dataclasses.is_dataclass(o) else str(o)))


def gib(n: float | None) -> float | None:
    return None if n is None else n / 2 ** 30
