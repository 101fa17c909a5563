#!/usr/bin/env bash
# `pytest -m gpu` on the GPU host, under a time limit, its log written as it runs to $OUT.
# From the project root, with .device set up (../shared/gpu/README.md):
#   . .device/setup.sh; OUT=$OUT bash benchmarks/gpu_check.sh            # default limit 240 s
#   GPU_CHECK_TIMEOUT_S=300 bash benchmarks/gpu_check.sh -x               # extra pytest arguments
# Only the files holding the selection are collected (the others may import TensorFlow, which
# that host lacks); addopts is reset because pytest-xdist is not installed there (-n would fail)
# unless it travels as a wheel in .device/whl: then the files run in GPU_CHECK_WORKERS (4)
# processes (their time is mostly compiling, CPU work: the host has 16 cores, one GPU shared).
# Writes $OUT/gpu_check.log and $OUT/gpu_check.xml (JUnit); exits with pytest's status (124: the
# time limit).
set -u
OUT=${OUT:-runs/gpu_check}; mkdir -p "$OUT"
FILES="tests/test_gpu.py tests/test_padded_attention.py tests/test_norms_dtn.py
       tests/test_norms_dtn_pallas.py tests/test_model.py tests/test_train_step.py tests/test_scan.py"
PYTEST_ARGS=()
python3 -c "import pytest_timeout" 2>/dev/null && PYTEST_ARGS=(--timeout=180)
python3 -c "import xdist" 2>/dev/null && [ "${GPU_CHECK_WORKERS:-4}" -gt 1 ] && \
  PYTEST_ARGS+=(-n "${GPU_CHECK_WORKERS:-4}" --dist loadfile)
{ python3 -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1
  echo "$ pytest -m gpu $(echo $FILES) ${PYTEST_ARGS[*]} $*"; } > "$OUT/gpu_check.log"
T0=$(date +%s)
timeout "${GPU_CHECK_TIMEOUT_S:-240}" python3 -m pytest -m gpu -o addopts="" -ra -v \
  -p no:cacheprovider --durations=10 --junitxml="$OUT/gpu_check.xml" "${PYTEST_ARGS[@]}" \
  $FILES "$@" >> "$OUT/gpu_check.log" 2>&1
RC=$?
echo "## pytest -m gpu rc=$RC in $(( $(date +%s) - T0 ))s" >> "$OUT/gpu_check.log"
tail -n 15 "$OUT/gpu_check.log"
exit $RC
