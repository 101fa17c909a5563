"""``python -m benchmarks.gpu_table --quick``: the GPU figures of issues 32 and 33 in one run of
at most ``--budget_s`` (default 480 s, compiles included) on one GPU.

Parts, in order of importance, each a subprocess whose log (``<out>/<part>.log``) and JSON are
written as they come (the parent's own lines in ``<out>/gpu_table.log``):

  vs_torch      ``vs_torch --model=B/16,S/16``: timm eager and torch.compile alternating with this
                project's LN step, both models in one torch process
  train_B16     ``train_step --one_process``: B/16 LayerNorm, DTN's Pallas kernels, DTN (+ the LN ``--variants``)
  train_S16     ``train_step --one_process``: S/16 LayerNorm, RepBN, progressive LN->RepBN,
                z-score->RepBN (+ the LN ``--variants``)
  norm_kernels  ``norm_kernels --model=B/16``: each norm layer alone (LN, DTN, RepBN, progressive,
                z-score->RepBN)
  train_<m>_recompute  (``--recompute=gelu``) ``train_step --one_process``: the LN step of B/16 and
                S/16 with ``model.recompute``, each in its own process (its own device peak)
  train_<m>_stream  (``--stream_layout=free``) the same with ``model.stream_layout``: the LN step
                as it was before the stream was pinned, beside the pinned one of this run
  profile       (``--profile``) ``benchmarks.profile``: B/16 LN step by op kind and model part

``--isolate_norms``: each norm of the train parts in its own process with its own share
(``train_B16_dtn``, ...; the variants in ``train_<model>_variants`` beside a LayerNorm row of
their own), at the cost of a process start each.

Budget: one deadline ``--budget_s`` from the start; a part gets the time left times its weight
over the weights of the parts still to run (``WEIGHTS``: expected seconds), so time a part does
not use goes to the ones after it and a slow part cannot eat the rest. A part past its share is
stopped (its process group killed); what it had written is kept (the ``train_step`` and
``vs_torch`` JSON is rewritten after every norm / model) and what it had not reached is listed as
not measured. Inside a part, norms start only within ``--time_budget_s`` (its share less
``CHILD_MARGIN_S``). A JAX persistent compilation cache (``--compile_cache``) lets ``vs_torch``
load the LN steps the train parts compiled instead of compiling them again.
Outputs: ``<out>/gpu_table.json`` (every part's status, seconds, share and results),
``<out>/gpu_table.md`` and ``<out>/gpu_table_bundle.tar.gz`` (every log and JSON of ``<out>`` in one
file: the GPU lending service returns at most 8 files of a command), all rewritten after every part.
``--parts=vs_torch,train_B16``: only those parts (their weights share ``--budget_s``).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys
import tarfile
import time
from typing import Any

from benchmarks import gpu_render, xla_flags

# Expected seconds of each part from a cold process. H200, 2026-11-27 (5b174bc): vs_torch from a
# cold cache did not finish in 118 s (two torch.compiles ~35 s each, our two LN steps compiled
# there first); train_B16 took 98 s (LN loaded from the cache, DTN 79 s of build + compile);
# train_S16 161 s for LN, RepBN and progressive (~50 s a norm: init and step compiles), so ~210 s
# with z-score; norm_kernels did not finish its five layers in 94 s. A variant adds one LN compile
# per model. With --isolate_norms each norm is a part: NORM_WEIGHTS. All of it is ~650 s, over
# the 480 s default: ``--parts`` splits the run in two (docs/benchmarks.md, "The quick run").
# train_B16 +40 s for DTN's Pallas kernels (dtn_pallas, 2026-11-28: not yet timed on a GPU; before
# XLA's DTN, timed on the H200 already, so that a part cut short loses the older figure).
WEIGHTS = {"vs_torch": 180.0, "train_B16": 170.0, "train_S16": 210.0, "norm_kernels": 130.0,
           "profile": 40.0}
VARIANT_WEIGHT = {"train_B16": 30.0, "train_S16": 20.0}
# --isolate_norms: a norm's own process; others NORM_WEIGHT
NORM_WEIGHTS = {"dtn": 110.0, "dtn_pallas": 110.0}
NORM_WEIGHT = 40.0
RECOMPUTE_WEIGHT = 70.0  # --recompute: a LayerNorm step in a process of its own (start, two compiles)
NORMS = {"train_B16": "layernorm,dtn_pallas,dtn",
         "train_S16": "layernorm,repbn,progressive,zscore_repbn"}
KERNEL_NORMS = "layernorm,dtn,dtn_pallas,repbn,progressive,zscore_repbn"
CHILD_MARGIN_S = 15.0  # a part's own --time_budget_s is its share less this
RESERVE_S = 3.0  # kept for writing the table at the end


def models(args: argparse.Namespace) -> dict[str, str]:
    """Part -> model preset (``--tiny``: small stand-ins for CPU)."""
    big, small = ("Ti/8", "Ti/4") if args.tiny else ("B/16", "S/16")
    return {"train_B16": big, "train_S16": small, "kernels": big, "profile": big}


def parts(args: argparse.Namespace) -> list[tuple[str, list[str], str, float]]:
    """(name, command, JSON path, weight) of every part, in the order they run."""
    py = [sys.executable, "-m"]
    m = models(args)
    size = ["--image_size=16", "--depth=1"] if args.tiny else []
    common = [f"--batch={args.batch}", f"--dtype={args.dtype}", f"--steps={args.steps}",
              f"--warmup={args.warmup}", f"--num_classes={args.num_classes}", *size]
    variants = [(n, f) for n, f in xla_flags.parse_variants(args.variants) if f]
    flags = "--ln_variants=" + ";".join(f"{n}={f}" for n, f in variants)
    out = []
    torch_ok = importlib.util.find_spec("torch") and importlib.util.find_spec("timm")
    if not args.no_torch and (torch_ok or args.dry_run):
        j = os.path.join(args.out, "vs_torch.json")
        out.append(("vs_torch", py + ["benchmarks.vs_torch",
                                      f"--model={m['train_B16']},{m['train_S16']}", *common,
                                      f"--json={j}"], j, WEIGHTS["vs_torch"]))
    for part in ("train_B16", "train_S16"):
        train = py + ["benchmarks.train_step", f"--model={m[part]}", "--one_process", *common]
        if not args.isolate_norms:
            j = os.path.join(args.out, f"{part}.json")
            # then every norm's step again, round-robin: ratios free of the drift between turns
            out.append((part, train + [f"--norm={NORMS[part]}", f"--json={j}",
                                       f"--interleave_rounds={args.steps}"]
                        + ([flags] if variants else []),
                        j, WEIGHTS[part] + VARIANT_WEIGHT[part] * len(variants)))
            continue
        for norm in NORMS[part].split(","):  # each its own process, share and timeout
            j = os.path.join(args.out, f"{part}_{norm}.json")
            out.append((f"{part}_{norm}", train + [f"--norm={norm}", f"--json={j}"], j,
                        NORM_WEIGHTS.get(norm, NORM_WEIGHT)))
        if variants:  # with a LayerNorm row of its own process for the same-process ratio
            j = os.path.join(args.out, f"{part}_variants.json")
            out.append((f"{part}_variants", train + ["--norm=layernorm", flags, f"--json={j}"],
                        j, NORM_WEIGHT + VARIANT_WEIGHT[part] * len(variants)))
    for suffix, flag, value, default in (("recompute", "recompute", args.recompute, "none"),
                                         ("stream", "stream_layout", args.stream_layout, "auto")):
        if value == default:
            continue
        for part in ("train_B16", "train_S16"):  # the LN step in its own process: its own peak
            j = os.path.join(args.out, f"{part}_{suffix}.json")
            cmd = py + ["benchmarks.train_step", f"--model={m[part]}", "--one_process", *common,
                        "--norm=layernorm", f"--{flag}={value}", f"--json={j}"]
            out.append((f"{part}_{suffix}", cmd, j, RECOMPUTE_WEIGHT))
    j = os.path.join(args.out, "norm_kernels.json")
    kern = ["--batch=2", "--steps=1", "--warmup=0"] if args.tiny else [
        f"--batch={args.batch}", f"--steps={args.steps}", f"--warmup={args.warmup}"]
    out.append(("norm_kernels", py + ["benchmarks.norm_kernels", f"--model={m['kernels']}",
                                      f"--norm={KERNEL_NORMS}", f"--dtype={args.dtype}", *kern,
                                      f"--json={j}"], j, WEIGHTS["norm_kernels"]))
    if args.profile:
        j = os.path.join(args.out, "profile.json")
        out.append(("profile", py + ["benchmarks.profile", f"--model={m['profile']}",
                                     "--norm=layernorm", f"--batch={args.batch}",
                                     f"--dtype={args.dtype}", f"--num_classes={args.num_classes}",
                                     "--steps=2", "--part=each", *size, f"--json={j}"],
                    j, WEIGHTS["profile"]))
    return select(out, args.parts)


def select(todo: list, names: str) -> list:
    """The parts named in ``names`` (comma list; '' = all), in the plan's order. A train part's
    name also selects its per-norm parts under --isolate_norms (``train_B16`` -> ``train_B16_dtn``),
    not its ``_recompute`` or ``_stream`` part, which are named on their own."""
    wanted = [n for n in names.split(",") if n]
    if not wanted:
        return todo
    own = ("_recompute", "_stream")
    keep = lambda name: any(name == w or (name.startswith(w + "_") and not name.endswith(own))
                            for w in wanted)
    return [t for t in todo if keep(t[0])]


def part_names(args: argparse.Namespace) -> list[str]:
    """Every part the plan has for these options (what ``--parts`` accepts)."""
    full = argparse.Namespace(**{**vars(args), "parts": "", "no_torch": False, "dry_run": True})
    return [name for name, *_ in parts(full)]


def share(left: float, weights: list[float]) -> float:
    """The first part's share of ``left`` seconds among parts of these weights."""
    return max(0.0, left) * weights[0] / sum(weights)


def _with_budget(name: str, cmd: list[str], timeout: float) -> list[str]:
    if name.startswith("train_") or name == "vs_torch":
        return cmd + [f"--time_budget_s={max(1.0, timeout - CHILD_MARGIN_S):.0f}"]
    return cmd


def run_part(cmd: list[str], json_path: str, log_path: str, timeout: float,
             env: dict[str, str]) -> dict[str, Any]:
    """Runs one part in its own process group under ``timeout``; its status, seconds and JSON
    (read even after a timeout: the parts rewrite it as they go)."""
    if os.path.exists(json_path):
        os.remove(json_path)  # a stale result must not pass for this run's
    t = time.monotonic()
    with open(log_path, "w") as log:
        log.write(f"$ {shlex.join(cmd)}\n# stopped after {timeout:.0f} s\n")
        log.flush()
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                             start_new_session=True)
        try:
            rc = p.wait(timeout=max(timeout, 0.1))
            status, reason = ("ok", None) if rc == 0 else ("failed", f"exit code {rc}")
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)  # the part and its children (torch's compile workers)
            p.wait()
            status, reason = "timeout", f"stopped at its share, {timeout:.0f} s"
    result = None
    try:
        with open(json_path) as f:
            result = json.load(f)
    except (OSError, ValueError) as e:
        if status == "ok":
            status, reason = "failed", f"no result ({e})"
    if status == "failed":
        reason = f"{reason}: {_tail(log_path)}"
    return {"status": status, "reason": reason, "seconds": round(time.monotonic() - t, 1),
            "timeout_s": round(timeout, 1), "log": log_path, "result": result}


def _tail(path: str, lines: int = 3) -> str:
    with open(path, errors="replace") as f:
        return " | ".join(s.strip() for s in f.readlines()[-lines:] if s.strip())


def child_env(args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if args.xla_flags:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + args.xla_flags).strip()
    if args.compile_cache:
        env["JAX_COMPILATION_CACHE_DIR"] = os.path.abspath(args.compile_cache)
    return env


def run(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.monotonic()
    todo = parts(args)
    if args.dry_run:
        total = sum(w for *_, w in todo)
        for name, cmd, _, w in todo:
            print(f"# {name}: {args.budget_s * w / total:.0f} s of --budget_s={args.budget_s:g} "
                  f"(weight {w:g}; more if earlier parts take less than theirs)")
            print(shlex.join(cmd))
        return {"commands": [c for _, c, _, _ in todo], "results": {}}
    os.makedirs(args.out, exist_ok=True)
    env = child_env(args)
    state: dict[str, Any] = {"budget_s": args.budget_s, "args": vars(args), "parts": {}}
    if args.no_torch or not any(n == "vs_torch" for n, *_ in todo):
        state["parts"]["vs_torch"] = {"status": "not run", "seconds": 0, "result": None,
                                      "reason": "--no_torch" if args.no_torch else
                                      f"--parts={args.parts}" if args.parts else
                                      "torch/timm not installed"}
    for i, (name, cmd, j, _) in enumerate(todo):
        left = args.budget_s - (time.monotonic() - t0) - RESERVE_S
        timeout = share(left, [w for *_, w in todo[i:]])
        if timeout < 10:
            state["parts"][name] = {"status": "skipped", "reason": "--budget_s spent", "seconds": 0,
                                    "result": None}
        else:
            state["parts"][name] = run_part(_with_budget(name, cmd, timeout), j,
                                            os.path.join(args.out, f"{name}.log"), timeout, env)
        p = state["parts"][name]
        line = (f"[gpu_table {time.monotonic() - t0:.0f} s] {name}: {p['status']} in "
                f"{p['seconds']:.0f} s of {timeout:.0f}" + (f" ({p['reason']})" if p.get("reason") else ""))
        print(line, file=sys.stderr, flush=True)
        with open(os.path.join(args.out, "gpu_table.log"), "a") as f:
            f.write(line + "\n")
        publish(state, args, t0)
    md = publish(state, args, t0)
    print(md)
    return {**state, "commands": [c for _, c, _, _ in todo], "markdown": md}


def publish(state: dict[str, Any], args: argparse.Namespace, t0: float) -> str:
    state["elapsed_s"] = round(time.monotonic() - t0, 1)
    state["summary"] = gpu_render.summary_rows(state["parts"])
    md = gpu_render.markdown(state, args)
    tmp = os.path.join(args.out, "gpu_table.md.tmp")  # written aside too, as the JSON
    with open(tmp, "w") as f:
        f.write(md + "\n")
    os.replace(tmp, os.path.join(args.out, "gpu_table.md"))
    tmp = os.path.join(args.out, "gpu_table.json.tmp")
    with open(tmp, "w") as f:
        json.dump(state, f, indent=1, default=str)
    os.replace(tmp, os.path.join(args.out, "gpu_table.json"))
    bundle(args.out)
    return md


BUNDLE = "gpu_table_bundle.tar.gz"


def bundle(out: str) -> str:
    """Every log, JSON and table in ``out`` as one ``BUNDLE`` (written aside, then renamed: a stop
    mid-write keeps the previous one)."""
    path, tmp = os.path.join(out, BUNDLE), os.path.join(out, BUNDLE + ".tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        for name in sorted(os.listdir(out)):
            if name.endswith((".log", ".json", ".md")):
                tar.add(os.path.join(out, name), arcname=name)
    os.replace(tmp, path)
    return path
