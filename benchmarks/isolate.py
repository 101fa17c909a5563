"""Run a benchmark once per variant (a normalizer), each in its own Python process.

Why: on an H100, ``train_step --norm=all`` (14 norms compiled and kept in one process) did not
finish in 420-560 s while each norm alone compiled in 20-50 s: compiled executables, their
buffers and XLA's caches pile up. One process per norm frees everything between norms, gives each
norm its own timeout (a hung compile costs that norm, not the table) and its own device peak
memory. The parent starts no JAX backend itself (on a GPU it would take the memory the children
need). Each child writes its log as it runs (``<out_dir>/<name>.log``) and its results as JSON.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from typing import Any, Callable, Sequence


@dataclasses.dataclass
class Outcome:
    """One child's run: status 'ok', 'failed' (non-zero exit or no JSON) or 'timeout'."""

    name: str
    status: str
    seconds: float
    result: dict[str, Any] | None
    reason: str | None
    log: str


def _tail(path: str, lines: int = 3) -> str:
    try:
        with open(path, errors="replace") as f:
            return " | ".join(line.strip() for line in f.readlines()[-lines:] if line.strip())
    except OSError:
        return ""


def run_one(name: str, cmd: Sequence[str], json_path: str, log_path: str, timeout_s: float,
            env: dict[str, str] | None = None, cwd: str | None = None) -> Outcome:
    """Runs ``cmd`` (which must write ``json_path``) with a timeout; never raises for the child's
    failure, so the caller goes on with the next variant."""
    t = time.perf_counter()
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        try:
            rc = subprocess.run(list(cmd), stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:  # subprocess.run has killed the child
            return Outcome(name, "timeout", time.perf_counter() - t, None,
                           f"timed out after {timeout_s:.0f} s", log_path)
    dt = time.perf_counter() - t
    if rc != 0:
        return Outcome(name, "failed", dt, None, f"exit code {rc}: {_tail(log_path)}", log_path)
    try:
        with open(json_path) as f:
            result = json.load(f)
    except (OSError, ValueError) as e:
        return Outcome(name, "failed", dt, None, f"no result ({e})", log_path)
    return Outcome(name, "ok", dt, result, None, log_path)


def run_isolated(names: Sequence[str], argv_for: Callable[[str, str], list[str]], module: str,
                 out_dir: str, timeout_s: float, python: str = sys.executable,
                 echo: Callable[[str], None] | None = None) -> list[Outcome]:
    """``python -m module *argv_for(name, json_path)`` for each name in turn, each with its own
    timeout; returns every outcome, failures included."""
    os.makedirs(out_dir, exist_ok=True)
    echo = echo or (lambda s: print(s, file=sys.stderr, flush=True))
    outcomes = []
    for name in names:
        json_path = os.path.join(out_dir, f"{name}.json")
        if os.path.exists(json_path):
            os.remove(json_path)  # a stale result must not pass for this run's
        cmd = [python, "-m", module, *argv_for(name, json_path)]
        o = run_one(name, cmd, json_path, os.path.join(out_dir, f"{name}.log"), timeout_s)
        echo(f"[isolate] {name}: {o.status} in {o.seconds:.1f} s" + (f" ({o.reason})" if o.reason else ""))
        outcomes.append(o)
    return outcomes
