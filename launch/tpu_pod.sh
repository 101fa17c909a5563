#!/usr/bin/env bash
# Train on a Cloud TPU VM slice (single host or pod): the same command starts on every worker,
# detached from the ssh session (setsid nohup), so a dropped connection does not stop the run;
# jax.distributed.initialize() finds the other hosts itself (normvit_jax/distributed.py).
#
#   TPU=my-v4-32 ZONE=us-central2-b bash launch/tpu_pod.sh CONFIG WORKDIR [main.py flags...]
#   TPU=my-v4-32 ZONE=us-central2-b bash launch/tpu_pod.sh configs/vit_dtn.py:imagenet gs://bucket/dtn \
#       --config.data.data_dir=gs://bucket/tensorflow_datasets
#   bash launch/tpu_pod.sh --dry-run CONFIG WORKDIR ...   # print the gcloud commands, run nothing
#                                   (without TPU/ZONE: <TPU>/<ZONE> stand in for them)
#
# Environment: TPU, ZONE (required, except for --dry-run); REPO: the git URL the workers clone (default: this
# checkout's `origin`; a warning when that is a local path, which the workers cannot clone); REF: the branch/commit to run (default: this checkout's HEAD commit:
# push it first; a branch runs its newest pushed commit, also on a worker that cloned before);
# LOG: the log file on each worker (default $HOME/normvit_<workdir name>.log; the exit code goes to LOG.rc).
# Follow worker 0:  gcloud compute tpus tpu-vm ssh $TPU --zone $ZONE --worker=0 --command 'tail -f LOG'
# Data: a tfds data dir on GCS prepared beforehand (array_record for ImageNet).
# Spot/preemptible slices: re-run this script after a preemption (without --fresh, which would
# start over); the run continues from its newest checkpoint in WORKDIR (exit code 42 in LOG.rc
# means a checkpoint was written on SIGTERM).
set -euo pipefail

usage() {  # the comment block at the top
  awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "${BASH_SOURCE[0]}"
}
dry_run=0
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --dry-run) dry_run=1; shift ;;
    *) break ;;
  esac
done
if [ $# -lt 2 ]; then usage >&2; echo "error: CONFIG and WORKDIR are required" >&2; exit 2; fi
if [ "$dry_run" = 1 ]; then  # what would run, with placeholders for what is not set yet
  TPU=${TPU:-<TPU>} ZONE=${ZONE:-<ZONE>}
fi
if [ -z "${TPU:-}" ]; then echo "error: set TPU to the TPU VM name (see --help)" >&2; exit 2; fi
if [ -z "${ZONE:-}" ]; then echo "error: set ZONE to the TPU VM's zone (see --help)" >&2; exit 2; fi
CONFIG=$1 WORKDIR=$2
shift 2
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
REPO=${REPO:-$(git -C "$here" remote get-url origin 2>/dev/null || true)}
REF=${REF:-$(git -C "$here" rev-parse HEAD 2>/dev/null || true)}
if [ -z "$REPO" ]; then
  echo "error: set REPO to the git URL the TPU workers should clone (this checkout has no origin)" >&2
  exit 2
fi
case "$REPO" in  # a path or file:// URL names this machine's disk, which the workers do not see
  /*|./*|../*|~*|file://*)
    echo "warning: REPO=$REPO is a path on this machine; the TPU workers clone it on their own disks, where it does not exist: set REPO to a URL they can reach (e.g. https://github.com/you/normvit_jax.git)" >&2 ;;
esac
run_name=$(basename "$WORKDIR")
LOG=${LOG:-"\$HOME/normvit_${run_name}.log"}   # expanded on the worker
# LOG goes into the worker's script in double quotes (its $HOME expands there, a space does not
# split it); the training command gets it as $0
log_dq=$(printf '%s' "$LOG" | sed 's/[\\"`]/\\&/g')
train=$(printf '%q ' python main.py "--config=$CONFIG" "--workdir=$WORKDIR" "$@")
inner=$(printf '%q' "$train; echo \$? > \"\$0.rc\"")   # the exit code, once the run ends
remote="set -e
log=\"$log_dq\"
[ -d normvit_jax ] || git clone -q $(printf '%q' "$REPO") normvit_jax
cd normvit_jax
git fetch -q origin
ref=$(printf '%q' "${REF:-origin/HEAD}")
if git rev-parse -q --verify \"refs/remotes/origin/\$ref^{commit}\" > /dev/null; then ref=origin/\$ref; fi
git checkout -q \"\$ref\"
pip install -q -e . 'jax[tpu]'
setsid nohup bash -c $inner \"\$log\" > \"\$log\" 2>&1 < /dev/null &
echo \"started on \$(hostname): log \$log\""
cmd=(gcloud compute tpus tpu-vm ssh "$TPU" --zone "$ZONE" --worker=all --command "$remote")
if [ "$dry_run" = 1 ]; then
  printf '%q ' "${cmd[@]}"; echo
  printf '# the --command above, as each worker runs it:\n%s\n' "$remote"
  exit 0
fi
"${cmd[@]}"
echo "Training runs in the background on every worker; follow it with:"
echo "  gcloud compute tpus tpu-vm ssh $TPU --zone $ZONE --worker=0 --command 'tail -f \"$log_dq\"'"
