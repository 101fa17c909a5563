#!/usr/bin/env bash
# Train one method config after another into runs/<method>, then build the comparison report.
#   VARIANT=demo bash launch/sweep.sh ln bn dtn un learnable_scaler
set -euo pipefail
cd "$(dirname "$0")/.."
VARIANT=${VARIANT:-demo}
methods=("${@:-ln bn gn in rms scalenorm powernorm un dtn dpn learnable_scaler rescale}")
runs=()
for m in ${methods[@]}; do
  python main.py --config="configs/vit_${m}.py:${VARIANT}" --workdir="runs/${VARIANT}_${m}" ${EXTRA:-}
  runs+=("runs/${VARIANT}_${m}")
done
python -m normvit_jax.analysis.report "${runs[@]}" --out="report/${VARIANT}"
