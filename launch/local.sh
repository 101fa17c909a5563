#!/usr/bin/env bash
# Train as N processes on this machine, joined by jax.distributed exactly as a multi-node job is
# (one coordinator, one process id each): to try a multi-process run before renting nodes, or to
# split one machine's GPUs into one process per GPU. Run from anywhere; main.py runs in the
# repository root.
#
#   bash launch/local.sh [options] CONFIG WORKDIR [main.py flags...]
#   bash launch/local.sh --processes=2 --cpu-devices=2 configs/vit_ln.py:demo runs/demo_mp
#   bash launch/local.sh --processes=8 --gpus-per-process=1 configs/vit_ln.py:s16,cifar100 runs/ln
#   bash launch/local.sh --dry-run --processes=2 CONFIG WORKDIR ...   # print the commands, run nothing
#
# Options:
#   --processes=N          processes to start (default 2)
#   --cpu-devices=K        CPU only: JAX_PLATFORMS=cpu and K host devices per process
#                          (XLA_FLAGS=--xla_force_host_platform_device_count=K)
#   --gpus-per-process=K   process i sees GPUs i*K .. i*K+K-1 (CUDA_VISIBLE_DEVICES)
#   --port=P               the coordinator's port on 127.0.0.1 (default: a free one)
#   --log-dir=DIR          process i writes DIR/process_<i>.log (default: all to this terminal,
#                          each line prefixed with [p<i>])
#   --grace=S              after a process fails, the others get S seconds to end by themselves
#                          before SIGKILL (default 30): a process whose peer died waits in a
#                          collective; this is what srun --kill-on-bad-exit does on a cluster
# Environment: PYTHON (default python); ENTRY, the script every process runs (default main.py;
# the tests run tests/fault_main.py, main.py with test instruments).
# Each process gets JAX_COORDINATOR_ADDRESS=127.0.0.1:P, JAX_NUM_PROCESSES=N, JAX_PROCESS_ID=i
# (what normvit_jax/distributed.py reads). SIGTERM or Ctrl-C (SIGINT) to this script: SIGTERM to
# every process (each finishes the same step, checkpoints and exits 42); a second Ctrl-C: SIGKILL.
# The exit code is the first non-zero one of a process (42: preempted with a checkpoint; re-run the
# same command, less --fresh, to continue), else 0.
set -euo pipefail

usage() {  # the comment block at the top
  awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "${BASH_SOURCE[0]}"
}
nproc_=2 cpu_devices="" gpus_per="" port="" log_dir="" grace=30 dry_run=0
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --dry-run) dry_run=1 ;;
    --processes=*) nproc_=${1#*=} ;;
    --cpu-devices=*) cpu_devices=${1#*=} ;;
    --gpus-per-process=*) gpus_per=${1#*=} ;;
    --port=*) port=${1#*=} ;;
    --log-dir=*) log_dir=${1#*=} ;;
    --grace=*) grace=${1#*=} ;;
    --) shift; break ;;
    -*) echo "error: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) break ;;
  esac
  shift
done
for v in "$nproc_" ${cpu_devices:+"$cpu_devices"} ${gpus_per:+"$gpus_per"} ${port:+"$port"} "$grace"; do
  case "$v" in ''|*[!0-9]*) echo "error: '$v' is not a whole number (see --help)" >&2; exit 2 ;; esac
done
if [ "$nproc_" -lt 1 ]; then echo "error: --processes must be >= 1" >&2; exit 2; fi
if [ -n "$cpu_devices" ] && [ -n "$gpus_per" ]; then
  echo "error: --cpu-devices and --gpus-per-process exclude each other" >&2; exit 2
fi
if [ $# -lt 2 ]; then usage >&2; echo "error: CONFIG and WORKDIR are required" >&2; exit 2; fi
CONFIG=$1 WORKDIR=$2
shift 2
PYTHON=${PYTHON:-python}
ENTRY=${ENTRY:-main.py}
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ -z "$port" ]; then
  if [ "$dry_run" = 1 ]; then port=PORT; else
    port=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  fi
fi

env_of() {  # the environment of process $1, as NAME=VALUE words
  local i=$1  # its own `local`: in `local i=$1 e=(...$i)` the $i is the caller's (shellcheck SC2318)
  local e=(JAX_COORDINATOR_ADDRESS="127.0.0.1:$port" JAX_NUM_PROCESSES="$nproc_" JAX_PROCESS_ID="$i")
  if [ -n "$cpu_devices" ]; then
    e+=(JAX_PLATFORMS=cpu XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_force_host_platform_device_count=$cpu_devices")
  fi
  if [ -n "$gpus_per" ]; then
    e+=(CUDA_VISIBLE_DEVICES="$(seq -s, $((i * gpus_per)) $((i * gpus_per + gpus_per - 1)))")
  fi
  printf '%s\0' "${e[@]}"
}

if [ "$dry_run" = 1 ]; then
  for ((i = 0; i < nproc_; i++)); do
    mapfile -d '' e < <(env_of "$i")
    printf '%q ' env "${e[@]}" "$PYTHON" "$ENTRY" "--config=$CONFIG" "--workdir=$WORKDIR" "$@"
    if [ -n "$log_dir" ]; then printf '> %q 2>&1 ' "$log_dir/process_$i.log"; fi
    echo "&"
  done
  echo "# then: wait for all; if one fails, SIGKILL the others after ${grace} s"
  exit 0
fi
[ -z "$log_dir" ] || mkdir -p "$log_dir"

declare -A index_of=()  # pid -> process index, for the processes still running
forward() { for p in "${!index_of[@]}"; do kill "-$1" "$p" 2>/dev/null || true; done; }
# Ctrl-C becomes SIGTERM: the processes start with SIGINT ignored (background jobs of a script),
# and with several processes only SIGTERM reaches JAX's preemption notifier (the same step on every
# process, a checkpoint, exit 42). A second Ctrl-C does not wait for the step and the save.
interrupts=0
# shellcheck disable=SC2329  # on_int is called by the trap below
on_int() {
  interrupts=$((interrupts + 1))
  if [ "$interrupts" = 1 ]; then
    echo "local.sh: Ctrl-C: SIGTERM to every process (each finishes its step, checkpoints and exits 42; Ctrl-C again stops them at once)" >&2
    forward TERM
  else
    echo "local.sh: Ctrl-C again: SIGKILL to every process (nothing saved since the last checkpoint)" >&2
    forward KILL
  fi
}
trap 'forward TERM' TERM
trap on_int INT
for ((i = 0; i < nproc_; i++)); do
  mapfile -d '' e < <(env_of "$i")
  if [ -n "$log_dir" ]; then
    env "${e[@]}" "$PYTHON" "$ENTRY" "--config=$CONFIG" "--workdir=$WORKDIR" "$@" \
      > "$log_dir/process_$i.log" 2>&1 &
  else  # $! is python's pid, not sed's: signals and exit codes are the process's own
    env "${e[@]}" "$PYTHON" "$ENTRY" "--config=$CONFIG" "--workdir=$WORKDIR" "$@" \
      > >(trap '' INT; exec sed -u "s/^/[p$i] /") 2>&1 &  # a terminal's Ctrl-C reaches sed too
  fi
  index_of[$!]=$i
  echo "local.sh: process $i of $nproc_: pid $!" >&2
done

rc=0 deadline=""
ended() {  # process with pid $1 ended with status $2
  echo "local.sh: process ${index_of[$1]} exited with $2" >&2
  unset "index_of[$1]"
  if [ "$2" != 0 ] && [ "$rc" = 0 ]; then
    rc=$2
    if [ "${#index_of[@]}" -gt 0 ]; then deadline=$((SECONDS + grace)); fi
  fi
}
while [ "${#index_of[@]}" -gt 0 ]; do
  if [ -n "$deadline" ] && [ "$SECONDS" -ge "$deadline" ]; then
    echo "local.sh: processes ${index_of[*]} still running ${grace} s after a failure: SIGKILL" >&2
    forward KILL
    deadline=""
  fi
  # bash drops a job killed by a signal from its job table once it has said so ("Killed"), and
  # `wait -n` then fails at once ("no such job") for it, over and over: several processes
  # SIGKILLed together. A plain `wait PID` still has its status.
  for p in "${!index_of[@]}"; do
    if ! kill -0 "$p" 2>/dev/null; then status=0; wait "$p" 2>/dev/null || status=$?; ended "$p" "$status"; fi
  done
  if [ "${#index_of[@]}" = 0 ]; then break; fi
  status=0 done_pid="" tick=""
  if [ -n "$deadline" ]; then sleep 1 & tick=$!; fi  # wakes the wait to check the deadline
  wait -n -p done_pid "${!index_of[@]}" $tick 2>/dev/null || status=$?
  if [ -n "$tick" ]; then kill "$tick" 2>/dev/null || true; fi
  if [ -z "${done_pid:-}" ] || [ "$done_pid" = "$tick" ]; then continue; fi  # a signal, the tick or a dropped job
  ended "$done_pid" "$status"
done
exit "$rc"
