#!/usr/bin/env bash
# Train one method config after another into runs/<variant>_<method>, then build the comparison
# report over the runs that finished. A method that fails does not stop the sweep: the others
# still run, the report is written without it, and the sweep exits 1 at the end naming it.
#
#   bash launch/sweep.sh [--dry-run] [METHOD...] [-- main.py flags...]
#   VARIANT=demo bash launch/sweep.sh ln bn dtn un learnable_scaler
#   bash launch/sweep.sh ln bn -- --config.total_steps=100
#
# METHOD: the <m> of configs/vit_<m>.py (default: every configs/vit_*.py, ln first, 17 today).
# VARIANT: the config variant (default demo). --dry-run prints the commands and runs nothing.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

usage() {  # the comment block at the top
  awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "${BASH_SOURCE[0]}"
}
VARIANT=${VARIANT:-demo}
PYTHON=${PYTHON:-python}
dry_run=0
methods=()
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --dry-run) dry_run=1 ;;
    --) shift; break ;;
    -*) echo "error: unknown option $1 (main.py flags go after --; see --help)" >&2; exit 2 ;;
    *) if [ ! -f "configs/vit_$1.py" ]; then
         echo "error: no configs/vit_$1.py; methods: $(ls configs/vit_*.py | sed 's|configs/vit_||; s|\.py||' | tr '\n' ' ')" >&2
         exit 2
       fi
       methods+=("$1") ;;
  esac
  shift
done
if [ ${#methods[@]} -eq 0 ]; then
  # every method config, LayerNorm first (the report's convergence reference)
  methods=(ln)
  for f in configs/vit_*.py; do
    m=${f#configs/vit_}; m=${m%.py}
    [ "$m" = ln ] || methods+=("$m")
  done
fi

run() {  # prints the command under --dry-run, else runs it
  if [ "$dry_run" = 1 ]; then printf '%q ' "$@"; echo; else "$@"; fi
}
runs=() failed=()
for m in "${methods[@]}"; do
  wd="runs/${VARIANT}_${m}"
  if run "$PYTHON" main.py "--config=configs/vit_${m}.py:${VARIANT}" "--workdir=$wd" "$@"; then
    runs+=("$wd")
  else
    rc=$?
    echo "sweep: $m failed (exit $rc); continuing without it" >&2
    failed+=("$m (exit $rc)")
  fi
done
if [ ${#runs[@]} -gt 0 ]; then
  run "$PYTHON" -m normvit_jax.analysis.report "${runs[@]}" "--out=report/${VARIANT}" \
    || failed+=("the report (exit $?)")
fi
if [ ${#failed[@]} -gt 0 ]; then
  echo "sweep: failed: ${failed[*]}" >&2
  exit 1
fi
