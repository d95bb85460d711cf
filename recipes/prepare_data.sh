#!/usr/bin/env bash
# GSM8K / MATH parquet files in verl's format, made by verl's own preprocessors
# (examples/data_preprocess/{gsm8k,math_dataset}.py in the verl repository; the wheel does not ship them).
#   bash recipes/prepare_data.sh [gsm8k] [math]        (default: both)
# Knobs: DATA_DIR (default ~/data), VERL_REPO (a verl checkout; cloned at v${VERL_VERSION:-0.9.1} if unset).
# Needs network access to the Hugging Face hub (datasets openai/gsm8k, DigitalLearningGmbH/MATH-lighteval).
set -euo pipefail
DATA_DIR=${DATA_DIR:-$HOME/data}
VERL_VERSION=${VERL_VERSION:-0.9.1}
if [[ -z "${VERL_REPO:-}" ]]; then
    VERL_REPO=${TMPDIR:-/tmp}/verl-v${VERL_VERSION}
    [[ -d "${VERL_REPO}" ]] || git clone --depth 1 --branch "v${VERL_VERSION}" https://github.com/volcengine/verl "${VERL_REPO}"
fi
tasks=("$@")
[[ ${#tasks[@]} -gt 0 ]] || tasks=(gsm8k math)

# the preprocessors' output flag changed names across verl versions
out_flag() { if python3 "$1" --help 2>/dev/null | grep -q -- '--local_save_dir'; then echo --local_save_dir; else echo --local_dir; fi; }

for task in "${tasks[@]}"; do
    case "${task}" in
        gsm8k) script=${VERL_REPO}/examples/data_preprocess/gsm8k.py ;;
        math) script=${VERL_REPO}/examples/data_preprocess/math_dataset.py ;;
        *) echo "unknown task ${task} (gsm8k or math)" >&2; exit 2 ;;
    esac
    python3 "${script}" "$(out_flag "${script}")" "${DATA_DIR}/${task}"
    ls -l "${DATA_DIR}/${task}/train.parquet" "${DATA_DIR}/${task}/test.parquet"
done
