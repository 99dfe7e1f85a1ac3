#!/usr/bin/env bash
# Multi-node DDP with torchrun's c10d rendezvous: run this same command on every node.
#   NNODES=2 GPUS_PER_NODE=8 RDZV_HOST=node-001 bash launch/torchrun_multinode.sh RECIPE.yaml [section.key=value ...]
# Every node must see the same repository, recipe and output_dir (a shared filesystem): checkpoints
# are written by all ranks into one folder and renamed by rank 0.
# FSDP2 instead of DDP: export ACCELERATE_USE_FSDP=true FSDP_VERSION=2 \
#   FSDP_AUTO_WRAP_POLICY=TRANSFORMER_BASED_WRAP FSDP_TRANSFORMER_CLS_TO_WRAP=DrafterLayer \
#   FSDP_STATE_DICT_TYPE=SHARDED_STATE_DICT   (what `accelerate launch` exports for launch/accelerate/fsdp2.yaml)
set -euo pipefail
RECIPE=${1:?usage: torchrun_multinode.sh RECIPE.yaml [overrides...]}
shift
NNODES=${NNODES:-2}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
RDZV_HOST=${RDZV_HOST:?set RDZV_HOST to the hostname of one node (it hosts the rendezvous)}
RDZV_PORT=${RDZV_PORT:-29400}
RUN_ID=${RUN_ID:-peagle-$(basename "$RECIPE" .yaml)}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
exec torchrun \
  --nnodes "$NNODES" --nproc_per_node "$GPUS_PER_NODE" \
  --rdzv_backend c10d --rdzv_endpoint "$RDZV_HOST:$RDZV_PORT" --rdzv_id "$RUN_ID" \
  --max_restarts 0 \
  -m peagle_train.cli train "$RECIPE" "$@"
