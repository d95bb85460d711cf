#!/usr/bin/env bash
# GRPO on MATH (lighteval) for Qwen3-{1.7B,4B}, baseline or aligned (ALIGN=none|rope|all).
#   MODEL_SIZE=4B ALIGN=rope bash recipes/grpo_qwen3_math.sh
# Knobs: see recipes/common.sh. Data: bash recipes/prepare_data.sh math
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "${HERE}/common.sh"

TASK=math
MODEL_FAMILY=qwen3
MODEL_SIZE=${MODEL_SIZE:-1.7B}
MODEL_PATH=${MODEL_PATH:-Qwen/Qwen3-${MODEL_SIZE}}
case "${MODEL_SIZE}" in
    1.7B) : "${MICRO_BATCH_PER_GPU:=8}" "${ROLLOUT_TP:=1}" ;;
    4B) : "${MICRO_BATCH_PER_GPU:=4}" "${ROLLOUT_TP:=2}" ;;
    *) echo "MODEL_SIZE must be 1.7B or 4B (or set MODEL_PATH and the batch knobs)" >&2; exit 2 ;;
esac
TRAIN_BATCH_SIZE=${TRAIN_BATCH_SIZE:-256}
PPO_MINI_BATCH_SIZE=${PPO_MINI_BATCH_SIZE:-64}
ROLLOUT_N=${ROLLOUT_N:-5}
MAX_PROMPT_LENGTH=${MAX_PROMPT_LENGTH:-1024}
MAX_RESPONSE_LENGTH=${MAX_RESPONSE_LENGTH:-3072}

rlalign_grpo_main "$@"
