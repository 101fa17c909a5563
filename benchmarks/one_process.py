"""Several train steps measured one after another in ONE process (``train_step --one_process``).

Why: on the GPU host a process costs ~10-15 s to start (imports, backend) before its compile;
``--isolate`` pays that per norm. Here each norm is compiled, warmed up and timed alone, then its
state and executable are freed before the next, so the norms share the process but not the
device at any moment. Ratios to LayerNorm are ratios of medians (as with ``--isolate``).

Peak memory: a device's ``peak_bytes_in_use`` only grows within a process (JAX cannot reset it).
A norm's peak is therefore known exactly only when it raises the process's peak (LayerNorm, run
first, always does); otherwise the row gives the upper bound ``device_peak_le_gib`` (the peak so
far). ``xla_peak_gib`` (XLA's buffer assignment of that executable) is given for every norm.

``--ln_variants='NAME=--xla_flag=v ...;...'`` adds LayerNorm rows compiled with other XLA flags
(per-compile options, ``xla_flags.flag_options``), after the norms, as ``layernorm@NAME``.
``--time_budget_s``: no norm starts after that many seconds; the JSON (``--json``) is rewritten
after every norm, so a parent that stops this process still finds what was measured.

``--interleave_rounds=N``: each norm's state and executable stay on the device after its own
timing, and at the end every kept step runs once per round, round-robin, for N rounds; each row
then also has ``interleaved_ratio``, the median [quartiles] of its per-round time over
LayerNorm's in the same round. Timed one after another, two norms see whatever drifts between
their turns (clocks, the other process's load): on an H200 the progressive and z-score->RepBN
steps, the same program up to one constant, measured 1.11x and 1.04x LN's in one run.
Its peak per norm stays what it measured alone (the memory held before a norm is subtracted).
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from typing import Any

import jax

from benchmarks import common, train_step, xla_flags

MIN_LEFT_S = 5.0  # do not start a norm with less of --time_budget_s left


def _process_start() -> float:
    """When this process started (Linux /proc; elsewhere now): imports and the backend's start
    count against a part's share, so the progress lines count from there."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


_START = _process_start()


def plan(args: argparse.Namespace, names: list[str]) -> list[tuple[str, str, str, dict]]:
    """(row name, norm, augmentation set, per-compile XLA options) in the order they run."""
    items = [(n if aug == "none" else f"{n}+{aug}", n, aug, {})
             for n in names for aug in args.augment.split(",")]
    for v, flags in xla_flags.parse_variants(args.ln_variants, "ln_variants"):
        if flags:
            items.append((f"layernorm@{v}", "layernorm", "none", xla_flags.flag_options(flags)))
    return items


def device_memory() -> tuple[int | None, int | None]:
    """(bytes in use, peak bytes in use) of device 0; (None, None) where it reports nothing."""
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("bytes_in_use"), stats.get("peak_bytes_in_use")


def log(message: str) -> None:
    """A progress line on stderr with the seconds since this process started (imports included):
    where a part's time went when it is stopped."""
    print(f"[one_process {time.time() - _START:.1f} s] {message}", file=sys.stderr, flush=True)


def measure(args: argparse.Namespace, name: str, norm: str, aug: str, options: dict,
            peak_flops: float) -> tuple[dict[str, Any], list[float], Any]:
    cfg = train_step.config(args, norm, aug)
    flops = train_step.analytic_flops(args, cfg, norm)
    log(f"{name}: building and compiling")
    bench = common.compile_train(name, cfg, num_classes=args.num_classes, compiler_options=options)
    log(f"{name}: model and state built in {bench.init_s:.1f} s (the init program's compile "
        f"included), step compiled in {bench.compile_s:.1f} s; {args.warmup} + {args.steps} steps")
    times = [bench.step() for _ in range(args.warmup + args.steps)][args.warmup:]
    log(f"{name}: median step {common.summarize(times).median:.4f} s")
    return train_step.row(args, bench, times, flops, peak_flops), times, bench


def interleave(kept: dict[str, Any], rounds: int, rows: list[dict[str, Any]],
               budget_left: float) -> str | None:
    """Times the kept steps round-robin and adds each row's ``interleaved_ratio``; the reason
    when it cannot (no LayerNorm kept, one step only, too little of the budget left)."""
    if "layernorm" not in kept or len(kept) < 2:
        return "needs LayerNorm and another step kept"
    by_name = {r["norm"]: r for r in rows}
    need = (rounds + 1) * sum(by_name[n]["step_median_s"] for n in kept)
    if need > budget_left - MIN_LEFT_S:
        return f"~{need:.0f} s needed, {budget_left:.0f} s of --time_budget_s left"
    log(f"interleaved: {rounds} rounds of {list(kept)}")
    times = common.interleaved({n: b.step for n, b in kept.items()}, rounds)
    for name, ratio in common.paired_ratios(times, "layernorm").items():
        by_name[name].update(interleaved_ratio=ratio.fmt(digits=3),
                             interleaved_ratio_median=ratio.median)
    return None


def _free() -> None:
    gc.collect()
    jax.clear_caches()


def run(args: argparse.Namespace, names: list[str]) -> dict[str, Any]:
    t0 = time.monotonic()
    budget = args.time_budget_s if args.time_budget_s else float("inf")
    items = plan(args, names)
    log(f"started; backend {jax.default_backend()}; plan {[n for n, *_ in items]}")
    peak_flops, peak_src = train_step.peak(args)
    rows: list[dict[str, Any]] = []
    times: dict[str, list[float]] = {}
    failures: list[dict[str, Any]] = []
    res: dict[str, Any] = {}
    top = 0  # the process's device peak so far
    kept: dict[str, Any] = {}  # --interleave_rounds: the steps kept on the device

    def publish(pending: list[str]) -> None:
        base = next((r for r in rows if r["norm"] == "layernorm"), None)
        if base is not None and len(rows) > 1:
            b = common.summarize(times["layernorm"])
            train_step.add_ratios(rows, {n: train_step._ratio_of_medians(common.summarize(ts), b)
                                         for n, ts in times.items()})
        res.update(machine=res.get("machine") or common.machine(), args=vars(args), rows=rows,
                   times=times, failures=failures, pending=pending, peak_flops=peak_flops,
                   peak_source=peak_src, one_process=True,
                   device_peak_gib=common.gib(top) if top else None)
        common.write_json(args.json, res)

    for i, (name, norm, aug, options) in enumerate(items):
        publish([n for n, *_ in items[i:]])
        left = budget - (time.monotonic() - t0)
        if left < MIN_LEFT_S:
            failures.append({"norm": name, "status": "skipped", "log": "-",
                             "reason": f"--time_budget_s={args.time_budget_s:g} spent"})
            continue
        in_use0, _ = device_memory()
        t = time.monotonic()
        try:
            row, ts, bench = measure(args, name, norm, aug, options, peak_flops)
        except Exception as e:  # noqa: BLE001 (an OOM or a bad flag costs this norm only)
            log(f"{name}: failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
            failures.append({"norm": name, "status": "failed", "log": "-",
                             "reason": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"})
            _free()
            continue
        if args.interleave_rounds:
            kept[name] = bench
        del bench
        _free()
        _, peak = device_memory()
        if peak is not None:
            if peak > top:
                row["device_peak_gib"] = common.gib(peak - (in_use0 or 0))
            else:
                row["device_peak_gib"] = None
                row["device_peak_le_gib"] = common.gib(top - (in_use0 or 0))
            top = max(top, peak)
        row["wall_s"] = round(time.monotonic() - t, 1)
        rows.append(row)
        times[name] = ts
    if kept:
        publish([])
        try:
            why = interleave(kept, args.interleave_rounds, rows,
                             budget - (time.monotonic() - t0))
        except Exception as e:  # noqa: BLE001 (an OOM here costs the interleaved column only)
            why = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        if why:
            log(f"interleaved: not measured: {why}")
            res["interleaved_skipped"] = why
        kept.clear()
        _free()
    publish([])
    return res
