"""Regenerates README's table of every method's demo: runs ``main.py --config=configs/<file>:demo``
for each method and seed, one after another (each in a fresh workdir), records each run's last
eval top-1/top-5, steps, wall time and CPU time with the machine, date, versions and command in
docs/demo_results.json (the one source of these numbers), and rewrites the rows between the
README's ``<!-- demo-table:begin -->`` and ``<!-- demo-table:end -->`` markers from that file, and
the README's demo-output block from the DTN run's output. When every method's workdir is there,
it also rebuilds the comparison report of those same runs (docs/report,
normvit_jax.analysis.report) and its table in docs/analysis.md; tests/test_demo_numbers.py fails
when README, docs and the file disagree.

    python -m benchmarks.demo_table                     # all seventeen x 3 seeds, ~70 min on 2 idle cores
    python -m benchmarks.demo_table --only=ln,dtn       # re-run two rows, keep the others
    python -m benchmarks.demo_table --dry-run           # print the commands, run nothing

Seed 0 is the README's command (the demos' default seed) and the table's top-1/top-5; seeds 1..N-1
(``--config.seed=k``) give the range beside it: what another seed, or a change that perturbs the
last bits of the arithmetic, moves the number by. The demos pin XLA:CPU's numerics
(``config.reproducible_cpu_threads``): the same bits on any core count of one CPU model, but not
across CPU models (2026-11-27: the LayerNorm demo printed 96.34% on an AVX2 EPYC and 98.31% on an
AVX-512 Xeon with the same pins). So a method's earlier runs on another CPU model are kept
(``other_machines``: CPU, date, versions, the top-1 of each seed) when it is re-run on a new one,
and the range column spans the seeds of every CPU model measured.
Timing, one way for every row: ``wall`` is the whole command (start-up, compilation and evals
included) by the clock, ``CPU`` its user+sys seconds (``getrusage`` of the child), which other jobs
on the machine change far less than the wall time; the load average at the start is recorded.
"""
from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import re
import resource
import shutil
import subprocess
import sys
import time
from typing import Sequence

from benchmarks import files
from normvit_jax import cli, tool_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEGIN, END = "<!-- demo-table:begin -->", "<!-- demo-table:end -->"
RESULTS = os.path.join(REPO, "docs", "demo_results.json")
REPORT = os.path.join(REPO, "docs", "report")
ANALYSIS_DOC = os.path.join(REPO, "docs", "analysis.md")
REPORT_BEGIN, REPORT_END = "<!-- demo-report:begin -->", "<!-- demo-report:end -->"
OUTPUT_BEGIN, OUTPUT_END = "<!-- demo-output:begin -->\n", "<!-- demo-output:end -->"
OUTPUT_METHOD = "dtn"  # the run whose whole output the README shows
PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "tensorflow", "tensorflow-cpu",
            "numpy")
HEADER = ("| method | config | top-1 | top-1 over seeds and CPUs | top-5 | wall | CPU |\n"
          "|---|---|---|---|---|---|---|\n")
METHODS = (  # key (--only), label, config file
    ("ln", "LayerNorm", "vit_ln.py"),
    ("bn", "BatchNorm", "vit_bn.py"),
    ("gn", "GroupNorm", "vit_gn.py"),
    ("in", "InstanceNorm", "vit_in.py"),
    ("rms", "RMSNorm", "vit_rms.py"),
    ("scalenorm", "ScaleNorm", "vit_scalenorm.py"),
    ("powernorm", "PowerNorm", "vit_powernorm.py"),
    ("un", "Unified Normalization", "vit_un.py"),
    ("dtn", "DTN (reference layout)", "vit_dtn.py"),
    ("dpn", "Dual PatchNorm", "vit_dpn.py"),
    ("learnable_scaler", "LearnableScaler", "vit_learnable_scaler.py"),
    ("rescale", "RescaleViT", "vit_rescale.py"),
    ("repbn", "RepBN", "vit_repbn.py"),
    ("progressive", "Progressive LN->RepBN", "vit_progressive.py"),
    ("zscore", "z-score->RepBN", "vit_dynamic_feature.py"),
    ("dyt", "DyT", "vit_dyt.py"),
    ("derf", "Derf", "vit_derf.py"),
)


def command(config_file: str, workdir: str, extra: Sequence[str] = ()) -> list[str]:
    return [sys.executable, "main.py", f"--config=configs/{config_file}:demo",
            f"--workdir={workdir}", *extra]


def last_eval(workdir: str) -> tuple[float, float]:
    """(top-1, top-5) of the last eval in the run's summaries."""
    return tuple(last_eval_step(workdir)[1:])


def last_eval_step(workdir: str) -> tuple[int, float, float]:
    """(step, top-1, top-5) of the last eval in the run's summaries."""
    from normvit_jax import summaries
    scalars = summaries.read_scalars(workdir)
    step, top1, _ = scalars["eval/top1"][-1]
    return int(step), top1, scalars["eval/top5"][-1][1]


def machine() -> dict:
    """Where the numbers were measured: CPU, cores, the load when the runs started, versions."""
    cpu, isa = platform.processor(), None
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read().splitlines()
        cpu = next((line.split(":", 1)[1].strip() for line in info
                    if line.startswith("model name")), cpu)
        flags = set(next((line.split(":", 1)[1].split() for line in info
                          if line.startswith("flags")), []))
        isa = next((name for flag, name in (("amx_tile", "AMX"), ("avx512f", "AVX-512"),
                                            ("avx2", "AVX2")) if flag in flags), None)
    except OSError:
        pass
    versions = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {"cpu": cpu, "isa": isa, "cores": os.cpu_count(), "platform": platform.platform(),
            "load_average_at_start": load, "versions": versions}


def workdir_of(root: str, key: str, seed: int) -> str:
    return os.path.join(root, key if seed == 0 else f"{key}_seed{seed}")


def run_one(key: str, config_file: str, root: str, extra: Sequence[str], seed: int = 0) -> dict:
    """One fresh run (the wall time includes start-up and compilation); its whole output goes to
    ``<workdir>.log`` and through to this process's stdout."""
    workdir = workdir_of(root, key, seed)
    if os.path.exists(workdir):
        shutil.rmtree(workdir)
    cmd = command(config_file, workdir, [*extra, *([f"--config.seed={seed}"] if seed else [])])
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(workdir + ".log", "w") as f:
        f.write(r.stdout)
    sys.stdout.write(r.stdout[-2000:])
    if r.returncode != 0:
        raise RuntimeError(f"{config_file}:demo exited with {r.returncode}")
    step, top1, top5 = last_eval_step(workdir)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"top1": top1, "top5": top5, "steps": step, "wall_s": round(wall, 1),
            "cpu_s": round(cpu, 1),
            "command": " ".join(["python"] + [a.replace(REPO + os.sep, "") for a in cmd[1:]])}


def run_seeds(key: str, config_file: str, root: str, extra: Sequence[str], seeds: int) -> dict:
    """Seed 0's run with the top-1 of every seed (``top1_seeds``, in seed order)."""
    runs = [run_one(key, config_file, root, extra, s) for s in range(seeds)]
    return {**runs[0], "top1_seeds": [r["top1"] for r in runs]}


def update_results(path: str, runs: dict[str, dict], env: dict, date: str) -> dict:
    """Adds the new runs (method key -> run_one's dict) to the results file, each with its date
    and machine; the other methods' entries are kept."""
    results = {"written_by": "python -m benchmarks.demo_table", "methods": {}}
    if os.path.exists(path):
        with open(path) as f:
            results = json.load(f)
    labels = {k: (label, f) for k, label, f in METHODS}
    for key, run in runs.items():
        results["methods"][key] = {"label": labels[key][0], "config": f"{labels[key][1]}:demo",
                                   **run, "date": date, "machine": env,
                                   "other_machines": kept_machines(results["methods"].get(key), env)}
    results["methods"] = {k: results["methods"][k] for k, _, _ in METHODS
                          if k in results["methods"]}
    files.write_text_atomic(path, json.dumps(results, indent=1, sort_keys=False) + "\n")
    return results


def kept_machines(previous: dict | None, env: dict) -> list[dict]:
    """The runs of a method on other CPU models than ``env``'s, from its previous entry (its own
    run and the ones it kept), one per CPU model, the newest first; same model: replaced."""
    if not previous:
        return []
    own = {"cpu": previous["machine"]["cpu"], "isa": previous["machine"].get("isa"),
           "date": previous["date"], "versions": previous["machine"].get("versions", {}),
           "top1_seeds": previous.get("top1_seeds") or [previous["top1"]]}
    model = lambda m: (m["cpu"], m.get("isa"))
    out = []
    for m in [own, *previous.get("other_machines", [])]:
        if model(m) != model(env) and all(model(m) != model(o) for o in out):
            out.append(m)
    return out


def rows_from_results(results: dict) -> dict[str, str]:
    """config file -> README row, for every method in the results file."""
    return {m["config"].split(":")[0]: row(m["label"], m["config"].split(":")[0], m)
            for m in results["methods"].values()}


def comparison_table(report_md: str) -> list[str]:
    """The lines of report.md's comparison table: its first section's (the convergence table
    follows under its own '## ' heading)."""
    return [line for line in report_md.split("\n## ")[0].splitlines() if line.startswith("|")]


def rebuild_report(root: str, report_dir: str = REPORT, doc: str = ANALYSIS_DOC) -> None:
    """The comparison report of the runs under ``root`` (one per method) into ``report_dir``,
    and its table into ``doc`` between the demo-report markers."""
    workdirs = [os.path.relpath(os.path.join(root, k), REPO) for k, _, _ in METHODS]
    subprocess.run([sys.executable, "-m", "normvit_jax.analysis.report", *workdirs,
                    f"--out={report_dir}"], cwd=REPO, check=True)
    with open(os.path.join(report_dir, "report.md")) as f:
        table = comparison_table(f.read())
    with open(doc) as f:
        text = f.read()
    head, rest = text.split(REPORT_BEGIN)
    _, tail = rest.split(REPORT_END)
    files.write_text_atomic(doc, f"{head}{REPORT_BEGIN}\n" + "\n".join(table)
                            + f"\n{REPORT_END}{tail}")


def all_top1(result: dict) -> list[float]:
    """The top-1 of every seed on every CPU model measured (this entry's and ``other_machines``)."""
    return [*(result.get("top1_seeds") or []),
            *(t for m in result.get("other_machines", []) for t in m["top1_seeds"])]


def seed_range(result: dict) -> tuple[float, float] | None:
    """(min, max) top-1 over the seeds and CPU models, or None when one run was made."""
    runs = all_top1(result)
    return (min(runs), max(runs)) if len(runs) > 1 else None


def row(label: str, config_file: str, result: dict) -> str:
    span = seed_range(result)
    cpus = 1 + len(result.get("other_machines", []))
    count = f"{len(all_top1(result))}" + (f", {cpus} CPUs" if cpus > 1 else "")
    seeds = (f"{100 * span[0]:.2f}-{100 * span[1]:.2f}% ({count})" if span else "-")
    cpu = f"{result['cpu_s']:.0f} s" if "cpu_s" in result else "-"
    return (f"| {label} | `{config_file}:demo` | {100 * result['top1']:.2f}% | {seeds} | "
            f"{100 * result['top5']:.2f}% | {result['wall_s']:.0f} s | {cpu} |")


def rewrite_output(readme: str, log: str, command_line: str) -> str:
    """README text with the demo-output block replaced by ``$ command_line`` and the run's log,
    indented as code."""
    head, rest = readme.split(OUTPUT_BEGIN)
    _, tail = rest.split(OUTPUT_END)
    lines = [f"$ {command_line}"] + [line for line in log.splitlines() if line.strip()]
    return head + OUTPUT_BEGIN + "".join(f"    {line}\n" for line in lines) + OUTPUT_END + tail


def rewrite(readme: str, new_rows: dict[str, str], date: str | None = None) -> str:
    """README text with the rows of ``new_rows`` (config file -> row) replaced or added in METHODS
    order; rows of methods not re-run are kept; with ``date``, the table's paragraph's
    'Measured on this machine on <date>' too. Raises ValueError without the markers."""
    if readme.count(BEGIN) != 1 or readme.count(END) != 1 or readme.index(BEGIN) > readme.index(END):
        raise ValueError(f"the README needs one {BEGIN} ... {END} pair around the demo table")
    head, rest = readme.split(BEGIN)
    body, tail = rest.split(END)
    old = {}
    for line in body.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 5 and cells[1].startswith("`"):
            old[cells[1].strip("`").split(":")[0]] = line.strip()
    rows = [new_rows.get(f) or old.get(f) for _, _, f in METHODS]
    table = HEADER + "".join(r + "\n" for r in rows if r)
    if date and new_rows:  # the last mention before the table is its own paragraph's
        found = list(re.finditer(r"Measured on this machine on \d{4}-\d{2}-\d{2}", head))
        if found:
            m = found[-1]
            head = f"{head[:m.start()]}Measured on this machine on {date}{head[m.end():]}"
    return f"{head}{BEGIN}\n{table}{END}{tail}"


def main(argv: Sequence[str] | None = None) -> int:
    """Bad input (a --readme without the table's markers, a damaged --results): one line and
    exit 2 before the runs, Ctrl-C one line and 130 (docs/faults.md)."""
    with cli.tool_errors("python -m benchmarks.demo_table"):
        return _main(argv)


def check_files(readme: str, results: str) -> None:
    """Before the runs (minutes each), not a traceback after them: --readme readable, with the
    table's markers, and writable; --results, if it exists, a JSON file; both writable."""
    try:
        with open(readme) as fh:
            rewrite(fh.read(), {})
    except OSError as e:
        raise ValueError(f"--readme={readme}: cannot be read ({type(e).__name__}: "
                         f"{e.strerror or e})") from None
    except ValueError as e:
        raise ValueError(f"--readme={readme}: {e}") from None
    tool_flags.check_output("readme", readme)
    tool_flags.check_output("results", results)
    if os.path.exists(results):
        try:
            with open(results) as fh:
                json.load(fh)
        except ValueError as e:
            raise ValueError(f"--results={results}: not a JSON file ({e}); move it aside or "
                             "pass another path") from None


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # main.py's own flags (--config.*, --fresh) pass through to every run
    extra = [a for a in argv if a.startswith(("--config.", "--fresh"))]
    ap = tool_flags.Parser("python -m benchmarks.demo_table", __doc__.split("\n\n")[0]
                           + "\nFlags --config.* and --fresh are passed on to main.py.")
    ap.add_argument("--only", default="", help="comma list of methods to re-run: "
                    + ",".join(k for k, _, _ in METHODS))
    ap.add_argument("--dry-run", dest="dry_run", action="store_true",
                    help="print the commands, run nothing")
    ap.add_argument("--readme", default=os.path.join(REPO, "README.md"),
                    help="the README whose demo table is rewritten")
    ap.add_argument("--root", default=os.path.join(REPO, "runs", "demo_table"),
                    help="parent of the runs' workdirs (each replaced)")
    ap.add_argument("--results", default=RESULTS, help="the JSON file the numbers are kept in")
    ap.add_argument("--seeds", type=tool_flags.positive_int, default=3,
                    help="seeds per method (0..N-1); seed 0 is "
                         "the table's run, the others give the range beside it")
    args = ap.parse_args([a for a in argv if a not in extra])
    args.extra = extra
    known = {k: (label, f) for k, label, f in METHODS}
    only = [k.strip() for k in args.only.split(",") if k.strip()] or list(known)
    unknown = [k for k in only if k not in known]
    if unknown:
        ap.error(f"unknown method(s) {unknown}; accepted: {list(known)}")
    if args.seeds < 1:
        ap.error(f"--seeds={args.seeds}; accepted: a positive integer")
    if args.dry_run:
        for k in only:
            for s in range(args.seeds):
                print(" ".join(command(known[k][1], workdir_of(args.root, k, s),
                                       [*args.extra, *([f"--config.seed={s}"] if s else [])])))
        return 0
    check_files(args.readme, args.results)
    env, runs, failed = machine(), {}, []
    for k in only:
        label, f = known[k]
        try:
            runs[k] = run_seeds(k, f, args.root, args.extra, args.seeds)
            print(row(label, f, runs[k]), flush=True)
        except Exception as e:  # noqa: BLE001  (one failed method: the others still update)
            print(f"demo_table: {k} failed: {e}", file=sys.stderr)
            failed.append(k)
    today = str(datetime.date.today())
    results = update_results(args.results, runs, env, today)
    new_rows = {f: r for f, r in rows_from_results(results).items()
                if f in {known[k][1] for k in runs}}
    with open(args.readme) as fh:
        text = fh.read()
    text = rewrite(text, new_rows, date=today)
    if OUTPUT_METHOD in runs and OUTPUT_BEGIN in text:
        with open(workdir_of(args.root, OUTPUT_METHOD, 0) + ".log") as fh:
            text = rewrite_output(text, fh.read(), runs[OUTPUT_METHOD]["command"])
    files.write_text_atomic(args.readme, text)  # README.md: never left half-written
    print(f"{args.readme}: {len(new_rows)} row(s) rewritten on {today}; {args.results} updated"
          + (f"; failed: {failed}" if failed else ""))
    if not failed and not args.extra and all(os.path.isdir(os.path.join(args.root, k))
                                              for k in known):
        rebuild_report(args.root)
        print(f"{REPORT} and {ANALYSIS_DOC} rebuilt from the runs in {args.root}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
