#!/usr/bin/env bash
# Train on a Cloud TPU pod slice: every worker runs the same command; jax.distributed.initialize()
# discovers the coordinator from the TPU metadata (no RAG_JAX_* variables needed).
#
#   TPU_NAME=my-v5p-64 ZONE=us-east5-a ./train/launch_tpu_pod.sh \
#       --config train/configs/llama3_8b_v5p.yaml data.data_dir=gs://bucket/tfds checkpoint.dir=gs://bucket/ckpt
#
# Prerequisites on every worker: the repo at $REPO_DIR and `pip install -e ".[tpu]"`. Check memory first on
# any machine:  python -m train.aot --config train/configs/llama3_8b_v5p.yaml --topology v5p-64
# DRY_RUN=1 prints the command every worker would get instead of running it (tests/test_slurm.py checks it).
set -euo pipefail
: "${TPU_NAME:?set TPU_NAME}" "${ZONE:?set ZONE}"
REPO_DIR="${REPO_DIR:-~/rag-jax}"
ARGS=$(printf ' %q' "$@")
CMD=(gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" --worker=all
     --command "cd $REPO_DIR && python -m train.train --auto_distributed$ARGS")
if [ -n "${DRY_RUN:-}" ]; then
    printf '%q ' "${CMD[@]}"; echo
else
    "${CMD[@]}"
fi
