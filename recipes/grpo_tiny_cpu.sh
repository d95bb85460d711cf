#!/usr/bin/env bash
# A real verl GRPO run on a CPU-only machine: verl 0.9.1's trainer, the vLLM CPU engine as rollout
# (vLLMHttpServer + agent loop), an FSDP2 actor and ref on gloo, weight sync every step, and the
# plugin's mismatch metrics; a tiny local Qwen2, synthetic prompts and a rule reward built on the fly.
# Nothing is downloaded.
#
#   bash recipes/grpo_tiny_cpu.sh                  # baseline, then all regions, then the report
#   ALIGN=rope bash recipes/grpo_tiny_cpu.sh       # one arm only (none|rope|all|<comma list>), no report
#
# Knobs: ALIGN (unset: both arms none+all and a report), STEPS (3), BATCH (4 prompts), N (2 samples per
# prompt), RESPONSE_LEN (24), LR (1e-6), OUT (runs/grpo_tiny_cpu), PYTHON (.venv/bin/python if present),
# DRY_RUN=print (print the command of the ALIGN arm) or DRY_RUN=1 (its composed config; nothing runs).
# Extra arguments are passed to verl as Hydra overrides. Each arm writes verl's file-logger JSONL to
# $OUT/<arm>.jsonl and its full log to $OUT/<arm>.log; the report goes to $OUT/report/ (PNG + HTML).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(dirname "${here}")
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "${root}/.venv/bin/python" ]]; then PYTHON="${root}/.venv/bin/python"; else PYTHON=python3; fi
fi
STEPS=${STEPS:-3}
BATCH=${BATCH:-4}
N=${N:-2}
RESPONSE_LEN=${RESPONSE_LEN:-24}
LR=${LR:-1e-6}
OUT=${OUT:-runs/grpo_tiny_cpu}
mkdir -p "${OUT}"
OUT=$(cd "${OUT}" && pwd)

# the CPU adaptations of rlalign_verl.verl.cpu, in every verl process (loaded by the verl.plugins entry point)
export RLALIGN_VERL_CPU=1
export VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} VLLM_NO_USAGE_STATS=1
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false RAY_DEDUP_LOGS=0 RAY_USAGE_STATS_ENABLED=0

inputs=$("${PYTHON}" -m rlalign_verl.verl.tiny_grpo "${OUT}/data" --num-prompts $((BATCH * STEPS)) | tail -n 1)
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

run_arm() {
    local arm=$1
    shift
    local -a cmd=(
        "${PYTHON}" -m rlalign_verl.main_ppo
        algorithm.adv_estimator=grpo
        algorithm.use_kl_in_reward=False
        "data.train_files=${TRAIN}" "data.val_files=${VAL}"
        "data.train_batch_size=${BATCH}" data.max_prompt_length=32 "data.max_response_length=${RESPONSE_LEN}"
        data.dataloader_num_workers=0 data.shuffle=False
        "actor_rollout_ref.model.path=${MODEL}"
        +actor_rollout_ref.model.override_config.attn_implementation=sdpa
        actor_rollout_ref.model.use_remove_padding=True
        actor_rollout_ref.actor.strategy=fsdp2
        "actor_rollout_ref.actor.optim.lr=${LR}"
        "actor_rollout_ref.actor.ppo_mini_batch_size=${BATCH}"
        actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=$((BATCH * N))
        actor_rollout_ref.actor.use_kl_loss=True actor_rollout_ref.actor.kl_loss_coef=0.001
        actor_rollout_ref.actor.entropy_coeff=0
        actor_rollout_ref.actor.use_torch_compile=False
        actor_rollout_ref.ref.strategy=fsdp2
        actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=$((BATCH * N))
        actor_rollout_ref.ref.use_torch_compile=False
        actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.mode=async
        "actor_rollout_ref.rollout.n=${N}"
        actor_rollout_ref.rollout.tensor_model_parallel_size=1
        actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=$((BATCH * N))
        actor_rollout_ref.rollout.calculate_log_probs=True
        actor_rollout_ref.rollout.max_num_seqs=$((BATCH * N))
        actor_rollout_ref.rollout.max_model_len=$((32 + RESPONSE_LEN))
        actor_rollout_ref.rollout.max_num_batched_tokens=512
        # vLLM's CPU platform has no sleep mode (vllm/config/model.py:621-623)
        +actor_rollout_ref.rollout.enable_sleep_mode=False actor_rollout_ref.rollout.free_cache_engine=False
        actor_rollout_ref.rollout.agent.num_workers=1
        "reward.custom_reward_function.path=${REWARD}" reward.custom_reward_function.name=compute_score
        reward.num_workers=1
        "alignment.regions=$(regions_of "${arm}")" alignment.metrics=True
        # Ray sees one "GPU" (the CPU platform's Ray resource name) and enough CPUs for the placement group
        +ray_kwargs.ray_init.num_gpus=1 ray_kwargs.ray_init.num_cpus=16
        transfer_queue.backend.SimpleStorage.num_data_storage_units=1
        trainer.n_gpus_per_node=1 trainer.nnodes=1
        trainer.critic_warmup=0 trainer.val_before_train=False trainer.test_freq=-1 trainer.save_freq=-1
        "trainer.total_training_steps=${STEPS}" trainer.total_epochs=1
        'trainer.logger=["console","file"]'
        trainer.project_name=grpo_tiny_cpu "trainer.experiment_name=${arm}"
    )
    cmd+=("$@")
    case "${DRY_RUN:-0}" in
        print) printf '%q ' "${cmd[@]}" && printf '\n' && return 0 ;;
        1 | true | yes) "${cmd[@]}" --cfg job --resolve && return 0 ;;
    esac
    echo "[grpo_tiny_cpu] arm=${arm}: alignment.regions=$(regions_of "${arm}") steps=${STEPS} (log: ${OUT}/${arm}.log)" >&2
    local jsonl="${OUT}/${arm}.jsonl"
    rm -f "${jsonl}"
    (cd "${OUT}" && VERL_FILE_LOGGER_PATH="${jsonl}" "${cmd[@]}") >"${OUT}/${arm}.log" 2>&1 || {
        echo "[grpo_tiny_cpu] arm=${arm} FAILED; last lines of ${OUT}/${arm}.log:" >&2
        tail -n 40 "${OUT}/${arm}.log" >&2
        return 1
    }
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
