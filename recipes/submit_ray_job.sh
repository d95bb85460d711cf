#!/usr/bin/env bash
# Submit a recipe to an existing Ray cluster through the Ray Jobs API (`ray job submit`).
#   RAY_ADDRESS=http://head-node:8265 NNODES=4 ALIGN=all bash recipes/submit_ray_job.sh recipes/grpo_qwen2_5_math.sh
# The repository is shipped as the job's working_dir and the package is pip-installed (--no-deps) in the job's
# runtime env on every node (RLALIGN_PIP, default: the shipped checkout), so `import verl` finds the
# verl.plugins entry point in every worker. The recipe knobs set in your environment are forwarded.
# Ray >= 2.60 clusters use token authentication: RAY_AUTH_MODE=token (set here unless given) and the cluster's
# token in ~/.ray/auth_token, RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN.
# The command waits for the job and exits with its status; a failed job's error is printed here.
# DRY_RUN=1 prints the command instead of submitting.
set -euo pipefail
RECIPE=${1:?usage: submit_ray_job.sh <recipe.sh> [verl overrides...]}
shift
: "${RAY_ADDRESS:?set RAY_ADDRESS to the cluster dashboard address, e.g. http://head:8265}"
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-token}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
REL_RECIPE=$(realpath --relative-to="${ROOT}" "${RECIPE}")
PY=${PYTHON:-python3}

runtime_env=$("${PY}" - "${ROOT}" <<'PY'
import json, os, sys
knobs = """ALIGN ALIGN_ENGINE ENGINE MODEL_SIZE MODEL_PATH NNODES NGPUS_PER_NODE TRAIN_BATCH_SIZE
PPO_MINI_BATCH_SIZE ROLLOUT_N MICRO_BATCH_PER_GPU ROLLOUT_TP GPU_MEM_UTIL MAX_PROMPT_LENGTH
MAX_RESPONSE_LENGTH LR KL_COEF TOTAL_EPOCHS STRATEGY DATA_DIR PROJECT EXPERIMENT LOGGER LOGGERS
STEPS BATCH N RESPONSE_LEN OUT VERL_FILE_LOGGER_PATH VERL_FILE_LOGGER_ROOT TENSORBOARD_DIR WANDB_API_KEY
WANDB_MODE WANDB_DIR VERL_USE_EXTERNAL_MODULES""".split()
print(json.dumps({
    "working_dir": sys.argv[1],
    "excludes": [".git", ".venv", ".venv-*", "runs", "rlalign_ablation", "*.egg-info", "__pycache__",
                 ".pytest_cache", ".ruff_cache", "test-artifacts"],
    # "${RAY_RUNTIME_ENV_CREATE_WORKING_DIR}" is the node-local copy of working_dir
    "pip": {"packages": [os.environ.get("RLALIGN_PIP", "${RAY_RUNTIME_ENV_CREATE_WORKING_DIR}")],
            "pip_install_options": ["--no-deps", "--no-build-isolation"]},
    "env_vars": {k: os.environ[k] for k in knobs if os.environ.get(k)},
}))
PY
)
# the job's driver runs on the head node with the nodes' python: the recipe must not pick a local venv
cmd=(ray job submit --address "${RAY_ADDRESS}" --runtime-env-json "${runtime_env}" -- env PYTHON=python bash "${REL_RECIPE}" "$@")
if [[ "${DRY_RUN:-0}" != 0 ]]; then
    printf '%q ' "${cmd[@]}"
    printf '\n'
    exit 0
fi
log=$(mktemp)
trap 'rm -f "${log}"' EXIT
status=0
"${cmd[@]}" 2>&1 | tee "${log}" || status=$?
job=$(grep -aoE "raysubmit_[A-Za-z0-9]+" "${log}" | head -n 1 || true)
if [[ -z "${job}" ]]; then
    echo "[rlalign-verl] ERROR ray job submit did not submit a job (exit ${status}); see its output above" >&2
    exit 1
fi
# the job's own state, from the Jobs API (ray job submit's exit status does not always carry it)
state=$("${PY}" - "${RAY_ADDRESS}" "${job}" <<'PY' 2>/dev/null || true
import sys
from ray.job_submission import JobSubmissionClient
print(JobSubmissionClient(sys.argv[1]).get_job_status(sys.argv[2]).value)
PY
)
if [[ "${state}" != "SUCCEEDED" ]]; then
    # the job's own one-line errors (they name the fix), else its last lines; the verdict line last
    logs=$(ray job logs --address "${RAY_ADDRESS}" "${job}" 2>/dev/null || true)
    errors=$(grep -a '^\[rlalign-verl\] ERROR' <<<"${logs}" | awk '!seen[$0]++' | tail -n 3 || true)
    if [[ -z "${errors}" ]]; then tail -n 25 <<<"${logs}" >&2; fi
    echo "[rlalign-verl] ERROR Ray job ${job} ended ${state:-in an unknown state} (ray job logs --address ${RAY_ADDRESS} ${job})" >&2
    if [[ -n "${errors}" ]]; then echo "${errors}" >&2; fi
    exit 1
fi
echo "[rlalign-verl] Ray job ${job} SUCCEEDED" >&2
