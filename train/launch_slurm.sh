#!/usr/bin/env bash
# Train on a SLURM GPU cluster: one task per GPU via srun; jax.distributed.initialize() reads the
# SLURM environment (SLURM_NTASKS, SLURM_PROCID, the node list) to find the coordinator.
#
#   sbatch --nodes=2 --ntasks-per-node=8 --gpus-per-node=8 train/launch_slurm.sh \
#       --config train/configs/llama3.2_1b_h200.yaml data.data_dir=/shared/tfds checkpoint.dir=/shared/ckpt
#
#SBATCH --job-name=rag-jax
#SBATCH --exclusive
#SBATCH --output=%x-%j.out
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-.}"
# One process per GPU: jax's SLURM detection gives each task the GPU numbered SLURM_LOCALID.
srun --kill-on-bad-exit=1 python -m train.train --auto_distributed "$@"
