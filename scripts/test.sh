#!/usr/bin/env bash
# Run the whole test suite (lint + the main suite + OpenRLHF's suite in its own environment).
set -euo pipefail
cd "$(dirname "$0")/.."
export VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 TOKENIZERS_PARALLELISM=false
.venv/bin/ruff check rlalign_verl tests benchmarks scripts
.venv/bin/ruff format --check rlalign_verl tests benchmarks scripts
.venv/bin/python -m pytest tests --durations=25 "$@"
# the version matrix (scripts/setup_matrix.sh): what depends on the library versions, on the other versions
if [ $# -eq 0 ]; then
    bash scripts/test_matrix.sh
fi
if [ -f scripts/test_openrlhf.sh ]; then
    bash scripts/test_openrlhf.sh
fi
