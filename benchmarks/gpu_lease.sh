#!/usr/bin/env bash
# One device call for every GPU figure of issues 32-34, under one deadline, from the project root
# with .device set up (../shared/gpu/README.md):
#   bash benchmarks/gpu_lease.sh                          # table, check, deploy; DEADLINE_S=575
#   STAGES="table deploy" TABLE_ARGS="--profile" bash benchmarks/gpu_lease.sh
# Stages, in the order given: table (`gpu_table --quick`, budget TABLE_S=400), check (`pytest -m
# gpu`, benchmarks/gpu_check.sh, at most 240 s), deploy (`benchmarks.deploy`'s StableHLO rows and the
# timm anchors on the GPU, DEPLOY_NORMS=layernorm,repbn), profile (`benchmarks.profile` of the B/16
# step of each of PROFILE_NORMS=dtn,layernorm, by op kind and model part, 120 s each at most),
# tiling (`norm_kernels`: one B/16 DTN layer, XLA's and the Pallas kernels' with their default
# tiling and each of DTN_TILINGS, 150 s at most; its table is in the archive and the output tail).
# Each stage gets what the deadline leaves.
# The device returns at most 8 files of $OUT: the runs write under runs/lease and only their
# tables, JSON and one archive of all logs are copied to $OUT (8 files at most).
set -u
# Known errors (a ValueError is exit 2, one line) show their traceback too: a lease's logs are all
# there is to tell a bug from bad input (docs/faults.md).
export NORMVIT_TRACEBACK=1
T0=$(date +%s); DEADLINE_S=${DEADLINE_S:-575}; STAGES=${STAGES:-"table check deploy"}
OUT=${OUT:-runs/lease_out}; RUNS=runs/lease; mkdir -p "$OUT" "$RUNS"
left() { echo $(( DEADLINE_S - ($(date +%s) - T0) )); }
stamp() { echo "$1 rc=$2 at $(( $(date +%s) - T0 ))s" >> "$RUNS/times.txt"; }
[ -f .device/setup.sh ] && . .device/setup.sh
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  git log -1 --format='%H %s'; git status --short
  python3 -c "import jax, flax, optax; print(jax.__version__, flax.__version__, optax.__version__, jax.devices())"
} > "$RUNS/machine.txt" 2>&1
for stage in $STAGES; do
  case $stage in
    table)  # leave the later stages ~150 s, if there are any
      RESERVE=150; [ "${STAGES##*table}" = "" ] && RESERVE=10
      L=$(( $(left) - RESERVE )); [ $L -lt 60 ] && L=60
      timeout $L python3 -m benchmarks.gpu_table --quick --budget_s=${TABLE_S:-400} \
        --compile_cache=runs/jax_cache --out=$RUNS/q ${TABLE_ARGS:-} > "$RUNS/gpu_table.log" 2>&1
      stamp table $?
      cp $RUNS/q/gpu_table.md $RUNS/q/gpu_table.json "$OUT"/ 2>/dev/null ;;
    check)
      L=$(( $(left) - 10 )); [ $L -gt 240 ] && L=240
      OUT=$RUNS/check GPU_CHECK_TIMEOUT_S=$L bash benchmarks/gpu_check.sh > /dev/null 2>&1
      stamp check $?
      cp $RUNS/check/gpu_check.log "$OUT"/ 2>/dev/null ;;
    deploy)  # its JSON is written after each norm: a stop keeps the rows so far
      L=$(( $(left) - 5 ))
      if [ $L -gt 40 ]; then
        timeout $L python3 -m benchmarks.deploy --runtimes=stablehlo --models=S/16 \
          --norms=${DEPLOY_NORMS:-layernorm,repbn} --json=$RUNS/deploy_gpu.json \
          --md=docs/benchmarks.md > "$RUNS/deploy.log" 2>&1
        stamp deploy $?
        cp $RUNS/deploy_gpu.json "$OUT"/ 2>/dev/null
        sed -n '/deploy-table-gpu:begin/,/deploy-table-gpu:end/p' docs/benchmarks.md > "$OUT/deploy_gpu.md"
      fi ;;
    tiling)
      L=$(( $(left) - 5 )); [ $L -gt 150 ] && L=150
      if [ $L -gt 40 ]; then
        timeout $L python3 -m benchmarks.norm_kernels --model=B/16 --batch=256 \
          --norm=layernorm,dtn,dtn_pallas --steps=10 --warmup=2 --json=$RUNS/tiling.json \
          --dtn_tilings=${DTN_TILINGS:-32/64/8:16/32/8,64/64/8:32/32/8,32/32/4:16/16/4} \
          > "$RUNS/tiling.log" 2>&1
        stamp tiling $?
      fi ;;
    profile)
      for norm in $(echo "${PROFILE_NORMS:-dtn,layernorm}" | tr , ' '); do
        L=$(( $(left) - 5 )); [ $L -gt 120 ] && L=120; [ $L -lt 30 ] && break
        timeout $L python3 -m benchmarks.profile --model=B/16 --norm=$norm --batch=256 \
          --dtype=bfloat16 --num_classes=1000 --steps=2 --part=each \
          --json=$RUNS/profile_$norm.json > "$RUNS/profile_$norm.log" 2>&1
        stamp "profile_$norm" $?
      done
      cat $RUNS/profile_*.log > "$OUT/profile.log" 2>/dev/null ;;
  esac
done
cp "$RUNS/times.txt" "$OUT"/
tar -czf "$OUT/lease_logs.tar.gz" --exclude=jax_cache --exclude=gpu_table_bundle.tar.gz "$RUNS" 2>/dev/null
cat "$RUNS/times.txt"; tail -n 3 "$RUNS/gpu_table.log" 2>/dev/null
tail -n 12 "$RUNS/tiling.log" 2>/dev/null
