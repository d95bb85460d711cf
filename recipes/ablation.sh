#!/usr/bin/env bash
# Baseline vs aligned: run one recipe with ALIGN=none, rope and all (same seed, same everything else),
# then compare their mismatch metrics with `rlalign-verl report`.
#   bash recipes/ablation.sh recipes/grpo_qwen2_5_gsm8k.sh [extra verl overrides...]
# Knobs: ALIGNS (default "none rope all"), OUT_DIR (default ./rlalign_ablation/<recipe>), plus every
# knob of the recipe (MODEL_SIZE, ENGINE, NNODES, ...). DRY_RUN=1 composes each config only.
set -euo pipefail
RECIPE=${1:?usage: ablation.sh <recipe.sh> [verl overrides...]}
shift
ALIGNS=${ALIGNS:-none rope all}
NAME=$(basename "${RECIPE}" .sh)
OUT_DIR=${OUT_DIR:-$PWD/rlalign_ablation/${NAME}}
mkdir -p "${OUT_DIR}"

runs=()
labels=()
for align in ${ALIGNS}; do
    log="${OUT_DIR}/${align}.jsonl"
    echo "[rlalign ablation] ${NAME}: ALIGN=${align} -> ${log}" >&2
    # verl's `file` logger writes every step's metrics (mismatch/* included) to VERL_FILE_LOGGER_PATH
    ALIGN=${align} VERL_FILE_LOGGER_PATH=${log} bash "${RECIPE}" "$@"
    runs+=("${log}")
    labels+=("${align}")
done

case "${DRY_RUN:-0}" in
    0 | "" | false | no)
        rlalign-verl report "${runs[@]}" --labels "$(IFS=,; echo "${labels[*]}")" \
            --title "${NAME}: baseline vs aligned" --out "${OUT_DIR}/report"
        echo "[rlalign ablation] report: ${OUT_DIR}/report/report.html" >&2
        ;;
    *) echo "[rlalign ablation] dry run: no report" >&2 ;;
esac
