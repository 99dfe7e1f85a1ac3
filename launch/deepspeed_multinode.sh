#!/usr/bin/env bash
# Multi-node DeepSpeed ZeRO with DeepSpeed's own launcher and a hostfile (passwordless ssh, same paths).
# Run on the first host of the hostfile:
#   bash launch/deepspeed_multinode.sh RECIPE.yaml [section.key=value ...]
#   DS_CONFIG=launch/deepspeed/zero3.json HOSTFILE=launch/deepspeed/hostfile bash launch/deepspeed_multinode.sh RECIPE.yaml
# The DeepSpeed launcher does not read accelerate configs: the two ACCELERATE_* variables below
# select DeepSpeed in the trainer, and .deepspeed_env carries them to the other nodes.
set -euo pipefail
RECIPE=${1:?usage: deepspeed_multinode.sh RECIPE.yaml [overrides...]}
shift
DS_CONFIG=${DS_CONFIG:-launch/deepspeed/zero2.json}
HOSTFILE=${HOSTFILE:-launch/deepspeed/hostfile}
export ACCELERATE_USE_DEEPSPEED=true
export ACCELERATE_DEEPSPEED_CONFIG_FILE=$DS_CONFIG
printf 'ACCELERATE_USE_DEEPSPEED=true\nACCELERATE_DEEPSPEED_CONFIG_FILE=%s\n' "$DS_CONFIG" > .deepspeed_env
exec deepspeed --hostfile "$HOSTFILE" --no_local_rank --module peagle_train.cli train "$RECIPE" "$@"
