# Shared by the GRPO recipes: knobs (environment variables), ALIGN handling and the launcher.
# A recipe sets TASK, MODEL_FAMILY and the size table, then calls `rlalign_grpo_main "$@"`.
#
# Knobs (all optional):
#   ALIGN=none|rope|all|<comma list>   regions to align; the baseline and the aligned run differ only here
#   ALIGN_ENGINE=auto|vllm|vllm-eager|sglang|...   engine profile (auto: chosen from the rollout settings)
#   ENGINE=vllm|sglang                  rollout engine
#   MODEL_SIZE, MODEL_PATH              model (MODEL_PATH overrides the hub id built from the size)
#   NNODES, NGPUS_PER_NODE              cluster shape (default 1 x 8)
#   TRAIN_BATCH_SIZE, PPO_MINI_BATCH_SIZE, ROLLOUT_N, MICRO_BATCH_PER_GPU, ROLLOUT_TP, GPU_MEM_UTIL
#   MAX_PROMPT_LENGTH, MAX_RESPONSE_LENGTH, LR, KL_COEF, TOTAL_EPOCHS, STRATEGY (fsdp|fsdp2)
#   DATA_DIR (default ~/data), PROJECT, EXPERIMENT, LOGGER (default ["console","file"])
#   DRY_RUN=1      compose the full config and print it (--cfg job --resolve); no Ray, no GPU
#   DRY_RUN=print  print the command that would run (shell-quoted) and exit
#   PYTHON         interpreter (default python3)
# Extra arguments are passed to verl as Hydra overrides (they win over the recipe's).

set -euo pipefail

rlalign_align_override() {
    case "${1}" in
        none | "" | "[]") echo "alignment.regions=[]" ;;
        rope) echo "alignment.regions=[rope]" ;;
        all) echo "alignment.regions=[rope,swiglu,rmsnorm]" ;;
        *) echo "alignment.regions=[${1}]" ;;
    esac
}

rlalign_grpo_main() {
    : "${TASK:?recipe must set TASK}" "${MODEL_FAMILY:?recipe must set MODEL_FAMILY}"
    ALIGN=${ALIGN:-none}
    ALIGN_ENGINE=${ALIGN_ENGINE:-auto}
    ENGINE=${ENGINE:-vllm}
    NNODES=${NNODES:-1}
    NGPUS_PER_NODE=${NGPUS_PER_NODE:-8}
    STRATEGY=${STRATEGY:-fsdp2}
    DATA_DIR=${DATA_DIR:-$HOME/data}
    LR=${LR:-1e-6}
    KL_COEF=${KL_COEF:-0.001}
    TOTAL_EPOCHS=${TOTAL_EPOCHS:-15}
    GPU_MEM_UTIL=${GPU_MEM_UTIL:-0.6}
    LOGGER=${LOGGER:-'["console","file"]'}
    PROJECT=${PROJECT:-rlalign_grpo_${TASK}}
    local model_tag
    model_tag=$(basename "${MODEL_PATH}" | tr '[:upper:]' '[:lower:]')
    EXPERIMENT=${EXPERIMENT:-${model_tag}_${ENGINE}_align-$(echo "${ALIGN}" | tr ',' '+')}

    local align_override
    align_override=$(rlalign_align_override "${ALIGN}")

    # the fixed settings are configs/experiment/grpo_gpu.yaml; here only what the knobs decide
    local -a cmd=(
        "${PYTHON:-python3}" -m rlalign_verl.main_ppo +experiment=grpo_gpu
        # --- data ------------------------------------------------------------------------------
        "data.train_files=${DATA_DIR}/${TASK}/train.parquet"
        "data.val_files=${DATA_DIR}/${TASK}/test.parquet"
        "data.train_batch_size=${TRAIN_BATCH_SIZE}"
        "data.max_prompt_length=${MAX_PROMPT_LENGTH}"
        "data.max_response_length=${MAX_RESPONSE_LENGTH}"
        # --- model, actor, rollout, ref --------------------------------------------------------
        "actor_rollout_ref.model.path=${MODEL_PATH}"
        "actor_rollout_ref.actor.strategy=${STRATEGY}"
        "actor_rollout_ref.actor.optim.lr=${LR}"
        "actor_rollout_ref.actor.ppo_mini_batch_size=${PPO_MINI_BATCH_SIZE}"
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=${MICRO_BATCH_PER_GPU}"
        "actor_rollout_ref.actor.kl_loss_coef=${KL_COEF}"
        "actor_rollout_ref.rollout.name=${ENGINE}"
        "actor_rollout_ref.rollout.n=${ROLLOUT_N}"
        "actor_rollout_ref.rollout.tensor_model_parallel_size=${ROLLOUT_TP}"
        "actor_rollout_ref.rollout.gpu_memory_utilization=${GPU_MEM_UTIL}"
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=${MICRO_BATCH_PER_GPU}"
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=${MICRO_BATCH_PER_GPU}"
        # --- alignment (rlalign-verl): the only setting that differs between ablation runs -----
        "${align_override}"
        "alignment.engine=${ALIGN_ENGINE}"
        # --- trainer ---------------------------------------------------------------------------
        "trainer.logger=${LOGGER}"
        "trainer.project_name=${PROJECT}"
        "trainer.experiment_name=${EXPERIMENT}"
        "trainer.n_gpus_per_node=${NGPUS_PER_NODE}"
        "trainer.nnodes=${NNODES}"
        "trainer.total_epochs=${TOTAL_EPOCHS}"
    )
    cmd+=("$@")

    case "${DRY_RUN:-0}" in
        print)
            printf '%q ' "${cmd[@]}"
            printf '\n'
            ;;
        1 | true | yes)
            "${cmd[@]}" --cfg job --resolve
            ;;
        *)
            echo "[rlalign recipe] ${EXPERIMENT}: ${align_override} alignment.engine=${ALIGN_ENGINE}" >&2
            "${cmd[@]}"
            ;;
    esac
}
