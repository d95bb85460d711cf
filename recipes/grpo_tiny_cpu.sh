#!/usr/bin/env bash
# A real verl GRPO run on a CPU-only machine: verl 0.9.1's trainer, the vLLM CPU engine as rollout
# (vLLMHttpServer + agent loop), an FSDP2 actor and ref on gloo, weight sync every step, the plugin's
# alignment, in-run verification and mismatch metrics; a tiny local Qwen2, synthetic prompts and a rule
# reward built on the fly. Nothing is downloaded. The fixed settings are configs/experiment/grpo_tiny_cpu.yaml.
#
#   bash recipes/grpo_tiny_cpu.sh                  # baseline, then all regions, then the report
#   ALIGN=rope bash recipes/grpo_tiny_cpu.sh       # one arm only (none|rope|all|<comma list>), no report
#   RAY_ADDRESS=... bash recipes/grpo_tiny_cpu.sh  # on an existing Ray cluster (recipes/submit_ray_job.sh does it)
#
# Knobs: ALIGN (unset: both arms none+all and a report), STEPS (3), BATCH (4 prompts), N (2 samples per
# prompt), RESPONSE_LEN (24), LR (1e-6), TP (1: the rollout's tensor-parallel size; TP=2 runs two FSDP workers
# and vLLM's two CPU ranks, BATCH*N must be divisible by TP), OUT (runs/grpo_tiny_cpu), LOGGERS (console,file),
# PYTHON (.venv/bin/python if present), DRY_RUN=print (print the command of the ALIGN arm) or DRY_RUN=1 (its
# composed config). Extra arguments are passed to verl as Hydra overrides. Each arm writes verl's file-logger
# JSONL to $OUT/<arm>.jsonl (a comma list's commas become +: ALIGN=rope,tp -> rope+tp.jsonl; TensorBoard events
# to $OUT/tensorboard/<arm> with LOGGERS=console,file,tensorboard; a wandb run under ${WANDB_DIR:-$OUT}/wandb/
# with wandb, WANDB_MODE=offline for no account) and its log to $OUT/<arm>.log; the report goes to
# $OUT/report/ (PNG + HTML).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(dirname "${here}")
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "${root}/.venv/bin/python" ]]; then PYTHON="${root}/.venv/bin/python"; else PYTHON=python3; fi
fi
STEPS=${STEPS:-3}
BATCH=${BATCH:-4}
N=${N:-2}
TP=${TP:-1}
RESPONSE_LEN=${RESPONSE_LEN:-24}
LR=${LR:-1e-6}
OUT=${OUT:-runs/grpo_tiny_cpu}
LOGGERS=${LOGGERS:-console,file}

# every knob is checked before anything starts (a bad one would otherwise surface ~40 s later inside Ray)
bad_knob() { echo "[rlalign-verl] ERROR grpo_tiny_cpu.sh: $1" >&2; exit 2; }
for knob in STEPS BATCH N RESPONSE_LEN TP; do
    value=${!knob}
    [[ "${value}" =~ ^[1-9][0-9]*$ ]] || bad_knob "${knob}=${value} is not a whole number >= 1; e.g. ${knob}=3"
done
"${PYTHON}" -c 'import sys; v = float(sys.argv[1]); assert v > 0 and v == v and v < float("inf")' "${LR}" 2>/dev/null \
    || bad_knob "LR=${LR} is not a positive number; e.g. LR=1e-6"
(((BATCH * N) % TP == 0)) || bad_knob "TP=${TP} does not divide BATCH*N=$((BATCH * N)) (each of the TP FSDP workers takes an equal share)"
for arg in "$@"; do  # the world size, Ray's resources and the micro-batches follow TP; the override alone breaks them
    [[ "${arg}" != *rollout.tensor_model_parallel_size=* ]] || bad_knob "set the rollout's tensor-parallel size with TP=<n>, not ${arg}"
done
IFS=, read -r -a logger_list <<<"${LOGGERS}"
for logger in "${logger_list[@]}"; do
    case "${logger}" in console | file | tensorboard | wandb) ;; *) bad_knob "LOGGERS has '${logger}'; use console,file,tensorboard,wandb" ;; esac
done
mkdir -p "${OUT}"
OUT=$(cd "${OUT}" && pwd)
if [[ ",${LOGGERS}," == *",wandb,"* ]]; then
    # wandb writes its run under $WANDB_DIR/wandb/ (the trainer's cwd otherwise: a Ray worker's dir in a cluster)
    export WANDB_DIR=${WANDB_DIR:-${OUT}}
fi

# the CPU adaptations of rlalign_verl.verl.cpu, in every verl process (loaded by the verl.plugins entry point)
export RLALIGN_VERL_CPU=1
export VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} VLLM_NO_USAGE_STATS=1
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false RAY_DEDUP_LOGS=0 RAY_USAGE_STATS_ENABLED=0

inputs=$("${PYTHON}" -m rlalign_verl.tools.tiny_grpo "${OUT}/data" --num-prompts $((BATCH * STEPS)) | tail -n 1)
field() { "${PYTHON}" -c 'import json,sys; print(json.loads(sys.argv[1])[sys.argv[2]])' "${inputs}" "$1"; }
MODEL=$(field model)
REWARD=$(field reward)
TRAIN=$(field train)
VAL=$(field val)

regions_of() {
    case "$1" in
        none | "" | "[]") echo "[]" ;;
        all) echo "[rope,swiglu,rmsnorm]" ;;
        *) echo "[$1]" ;;
    esac
}

# inside a Ray job (recipes/submit_ray_job.sh): is env var $1 in the job's runtime env, which every actor gets?
in_job_env() {
    [[ -n "${RAY_JOB_CONFIG_JSON_ENV_VAR:-}" ]] || return 1
    "${PYTHON}" -c 'import json, os, sys
env = (json.loads(os.environ["RAY_JOB_CONFIG_JSON_ENV_VAR"]).get("runtime_env") or {}).get("env_vars") or {}
sys.exit(0 if sys.argv[1] in env else 1)' "$1"
}

run_arm() {
    local arm=$1
    shift
    # a comma list (ALIGN=rope,tp) names its files and experiment with '+' (a comma is a Hydra list/sweep)
    local tag=${arm//,/+}
    local jsonl="${OUT}/${tag}.jsonl"
    local -a env_vars=("++ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH=${jsonl}")
    if [[ ",${LOGGERS}," == *",tensorboard,"* ]]; then
        env_vars+=("++ray_kwargs.ray_init.runtime_env.env_vars.TENSORBOARD_DIR=${OUT}/tensorboard/${tag}")
    fi
    for name in VERL_USE_EXTERNAL_MODULES PYTHONPATH WANDB_MODE WANDB_DIR; do  # reach the workers of a cluster too
        # unless the Ray job's runtime env has it already (submit_ray_job.sh): Ray refuses the same key twice
        if [[ -n "${!name:-}" ]] && ! in_job_env "${name}"; then
            env_vars+=("++ray_kwargs.ray_init.runtime_env.env_vars.${name}=${!name}")
        fi
    done
    local -a ray_resources=()
    if [[ -z "${RAY_ADDRESS:-}" ]]; then
        # a local Ray: one "GPU" per FSDP worker (the CPU platform's Ray resource name) and enough CPUs for the placement group;
        # an existing cluster brings its own resources (ray.init refuses them there)
        ray_resources=(+ray_kwargs.ray_init.num_gpus="${TP}" ray_kwargs.ray_init.num_cpus=16)
    fi
    local micro=$((BATCH * N / TP))  # per FSDP worker: each of the TP workers holds BATCH*N/TP samples
    local -a cmd=(
        "${PYTHON}" -m rlalign_verl.main_ppo +experiment=grpo_tiny_cpu
        "data.train_files=${TRAIN}" "data.val_files=${VAL}"
        "data.train_batch_size=${BATCH}" "data.max_response_length=${RESPONSE_LEN}"
        "actor_rollout_ref.model.path=${MODEL}"
        "actor_rollout_ref.actor.optim.lr=${LR}"
        "actor_rollout_ref.actor.ppo_mini_batch_size=${BATCH}"
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=${micro}"
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=${micro}"
        "actor_rollout_ref.rollout.n=${N}"
        "actor_rollout_ref.rollout.tensor_model_parallel_size=${TP}" "trainer.n_gpus_per_node=${TP}"
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=${micro}"
        "actor_rollout_ref.rollout.max_num_seqs=$((BATCH * N))"
        "actor_rollout_ref.rollout.max_model_len=$((32 + RESPONSE_LEN))"
        "reward.custom_reward_function.path=${REWARD}"
        "alignment.regions=$(regions_of "${arm}")" alignment.metrics=True
        "${ray_resources[@]}" "${env_vars[@]}"
        "trainer.total_training_steps=${STEPS}"
        "trainer.logger=[${LOGGERS}]"
        "trainer.experiment_name=${tag}"
    )
    cmd+=("$@")
    case "${DRY_RUN:-0}" in
        print) printf '%q ' "${cmd[@]}" && printf '\n' && return 0 ;;
        1 | true | yes) "${cmd[@]}" --cfg job --resolve; return $? ;;  # never a real run after a failed compose
    esac
    echo "[grpo_tiny_cpu] arm=${arm}: alignment.regions=$(regions_of "${arm}") steps=${STEPS} (log: ${OUT}/${tag}.log)" >&2
    rm -f "${jsonl}"
    local status=0
    (cd "${OUT}" && VERL_FILE_LOGGER_PATH="${jsonl}" "${cmd[@]}") >"${OUT}/${tag}.log" 2>&1 || status=$?
    if [[ ${status} -ne 0 ]]; then
        # our own one-line errors first (a stopped run names its fix), then the log's tail
        grep -a '^\[rlalign-verl\] ERROR' "${OUT}/${tag}.log" | tail -n 3 >&2 || true
        echo "[grpo_tiny_cpu] arm=${arm} FAILED (exit ${status}); last lines of ${OUT}/${tag}.log:" >&2
        tail -n 40 "${OUT}/${tag}.log" >&2
        return "${status}"
    fi
    echo "[grpo_tiny_cpu] arm=${arm} done: ${jsonl}" >&2
}

if [[ -n "${ALIGN:-}" || "${DRY_RUN:-0}" != 0 ]]; then
    run_arm "${ALIGN:-none}" "$@"
    exit 0
fi
run_arm none "$@"
run_arm all "$@"
"${PYTHON}" -m rlalign_verl report "${OUT}/none.jsonl" "${OUT}/all.jsonl" --labels baseline,all --out "${OUT}/report"
echo "[grpo_tiny_cpu] report: ${OUT}/report/" >&2
