#!/usr/bin/env bash
# Multi-node: submit a recipe to an existing Ray cluster with `ray job submit`.
#   RAY_ADDRESS=http://head-node:8265 NNODES=4 ALIGN=all bash recipes/submit_ray_job.sh recipes/grpo_qwen2_5_math.sh
# The repository is shipped as the job's working_dir, and the package is pip-installed (--no-deps) in the
# job's runtime env on every node (RLALIGN_PIP, default: the shipped checkout), so `import verl` finds
# the verl.plugins entry point in every worker. The recipe knobs set in your environment are forwarded.
# DRY_RUN=1 prints the command instead of submitting.
set -euo pipefail
RECIPE=${1:?usage: submit_ray_job.sh <recipe.sh> [verl overrides...]}
shift
: "${RAY_ADDRESS:?set RAY_ADDRESS to the cluster dashboard address, e.g. http://head:8265}"
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
REL_RECIPE=$(realpath --relative-to="${ROOT}" "${RECIPE}")

runtime_env=$(python3 - "${ROOT}" <<'PY'
import json, os, sys
knobs = """ALIGN ALIGN_ENGINE ENGINE MODEL_SIZE MODEL_PATH NNODES NGPUS_PER_NODE TRAIN_BATCH_SIZE
PPO_MINI_BATCH_SIZE ROLLOUT_N MICRO_BATCH_PER_GPU ROLLOUT_TP GPU_MEM_UTIL MAX_PROMPT_LENGTH
MAX_RESPONSE_LENGTH LR KL_COEF TOTAL_EPOCHS STRATEGY DATA_DIR PROJECT EXPERIMENT LOGGER
VERL_FILE_LOGGER_PATH VERL_FILE_LOGGER_ROOT WANDB_API_KEY""".split()
print(json.dumps({
    "working_dir": sys.argv[1],
    "excludes": [".git", ".venv", "rlalign_ablation"],
    # "${RAY_RUNTIME_ENV_CREATE_WORKING_DIR}" is the node-local copy of working_dir
    "pip": {"packages": [os.environ.get("RLALIGN_PIP", "${RAY_RUNTIME_ENV_CREATE_WORKING_DIR}")],
            "pip_install_options": ["--no-deps"]},
    "env_vars": {k: os.environ[k] for k in knobs if os.environ.get(k)},
}))
PY
)
cmd=(ray job submit --address "${RAY_ADDRESS}" --runtime-env-json "${runtime_env}" -- bash "${REL_RECIPE}" "$@")
if [[ "${DRY_RUN:-0}" != 0 ]]; then
    printf '%q ' "${cmd[@]}"
    printf '\n'
    exit 0
fi
"${cmd[@]}"
