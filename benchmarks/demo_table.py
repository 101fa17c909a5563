"""Regenerates README's table of every method's demo: runs ``main.py --config=configs/<file>:demo``
for each method, one after another (each in a fresh workdir), and rewrites the rows between the
README's ``<!-- demo-table:begin -->`` and ``<!-- demo-table:end -->`` markers with the last
eval's top-1/top-5 and the wall time (start-up and compilation included).

    python -m benchmarks.demo_table                     # all twelve, ~15 minutes on a 2-core CPU
    python -m benchmarks.demo_table --only=ln,dtn       # re-run two rows, keep the others
    python -m benchmarks.demo_table --dry-run           # print the commands, run nothing

Run it on an otherwise idle machine: the wall times are what the table reports.
"""
from __future__ import annotations

import datetime
import os
import re
import shutil
import subprocess
import sys
import time
from typing import Sequence

from normvit_jax import tool_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEGIN, END = "<!-- demo-table:begin -->", "<!-- demo-table:end -->"
HEADER = "| method | config | top-1 | top-5 | wall |\n|---|---|---|---|---|\n"
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
)


def command(config_file: str, workdir: str, extra: Sequence[str] = ()) -> list[str]:
    return [sys.executable, "main.py", f"--config=configs/{config_file}:demo",
            f"--workdir={workdir}", *extra]


def last_eval(workdir: str) -> tuple[float, float]:
    """(top-1, top-5) of the last eval in the run's summaries."""
    from normvit_jax import summaries
    scalars = summaries.read_scalars(workdir)
    return scalars["eval/top1"][-1][1], scalars["eval/top5"][-1][1]


def run_one(key: str, config_file: str, root: str, extra: Sequence[str]) -> dict:
    workdir = os.path.join(root, key)
    if os.path.exists(workdir):
        shutil.rmtree(workdir)  # a fresh run: the wall time must include start-up and compile
    t0 = time.perf_counter()
    r = subprocess.run(command(config_file, workdir, extra), cwd=REPO)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"{config_file}:demo exited with {r.returncode}")
    top1, top5 = last_eval(workdir)
    return {"top1": top1, "top5": top5, "wall_s": wall}


def row(label: str, config_file: str, result: dict) -> str:
    return (f"| {label} | `{config_file}:demo` | {100 * result['top1']:.2f}% | "
            f"{100 * result['top5']:.2f}% | {result['wall_s']:.0f} s |")


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
        if len(cells) == 5 and cells[1].startswith("`"):
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
    argv = list(sys.argv[1:] if argv is None else argv)
    # main.py's own flags (--config.*, --fresh) pass through to every run
    extra = [a for a in argv if a.startswith(("--config.", "--fresh"))]
    ap = tool_flags.Parser("python -m benchmarks.demo_table", __doc__.split("\n\n")[0]
                           + "\nFlags --config.* and --fresh are passed on to main.py.")
    ap.add_argument("--only", default="", help="comma list of methods to re-run: "
                    + ",".join(k for k, _, _ in METHODS))
    ap.add_argument("--dry-run", dest="dry_run", action="store_true",
                    help="print the commands, run nothing")
    ap.add_argument("--readme", default=os.path.join(REPO, "README.md"))
    ap.add_argument("--root", default=os.path.join(REPO, "runs", "demo_table"),
                    help="parent of the runs' workdirs (each replaced)")
    args = ap.parse_args([a for a in argv if a not in extra])
    args.extra = extra
    known = {k: (label, f) for k, label, f in METHODS}
    only = [k.strip() for k in args.only.split(",") if k.strip()] or list(known)
    unknown = [k for k in only if k not in known]
    if unknown:
        ap._fail(f"unknown method(s) {unknown}; accepted: {list(known)}")
    if args.dry_run:
        for k in only:
            print(" ".join(command(known[k][1], os.path.join(args.root, k), args.extra)))
        return 0
    new_rows, failed = {}, []
    for k in only:
        label, f = known[k]
        try:
            new_rows[f] = row(label, f, run_one(k, f, args.root, args.extra))
            print(new_rows[f], flush=True)
        except Exception as e:  # noqa: BLE001  (one failed method: the others still update)
            print(f"demo_table: {k} failed: {e}", file=sys.stderr)
            failed.append(k)
    with open(args.readme) as fh:
        text = fh.read()
    with open(args.readme, "w") as fh:
        fh.write(rewrite(text, new_rows, date=str(datetime.date.today())))
    print(f"{args.readme}: {len(new_rows)} row(s) rewritten on {datetime.date.today()}"
          + (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
