#!/usr/bin/env bash
# Train on a Cloud TPU VM slice (single host or pod): the same command runs on every worker;
# jax.distributed.initialize() finds the other hosts itself (normvit_jax/sharding.py).
#   TPU=my-v4-32 ZONE=us-central2-b CONFIG=configs/vit_dtn.py:imagenet WORKDIR=gs://bucket/dtn bash launch/tpu_pod.sh
# Data: a tfds data dir on GCS prepared beforehand (array_record for ImageNet), e.g.
#   EXTRA="--config.data.data_dir=gs://bucket/tensorflow_datasets"
set -euo pipefail
: "${TPU:?set TPU to the TPU VM name}" "${ZONE:?set ZONE}" "${CONFIG:?set CONFIG}" "${WORKDIR:?set WORKDIR (gs://...)}"
REPO=${REPO:-https://github.com/your-org/normvit_jax.git}
gcloud compute tpus tpu-vm ssh "$TPU" --zone "$ZONE" --worker=all --command "
  set -e
  [ -d normvit_jax ] || git clone -q $REPO normvit_jax
  cd normvit_jax && git pull -q
  pip install -q -e . 'jax[tpu]'
  python main.py --config=$CONFIG --workdir=$WORKDIR ${EXTRA:-}
"
# Preemptible/spot slices: re-run this script after a preemption; the run continues from its
# newest checkpoint in WORKDIR (exit code 42 means a checkpoint was written on SIGTERM).
