#!/usr/bin/env bash
# Run the whole test suite: lint, the main suite, the version matrix and OpenRLHF's suite (its own environment).
# Every tier runs even when an earlier one fails (one red test must not hide the others); the script fails at
# the end, naming each tier that failed. Extra arguments go to the main suite's pytest (and skip the other tiers).
set -uo pipefail
cd "$(dirname "$0")/.."
export VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 TOKENIZERS_PARALLELISM=false
failed=()
tier() {  # tier NAME COMMAND...: run it, remember a failure, go on
    local name=$1
    shift
    echo "== tier ${name}: $*"
    local start=$SECONDS
    if "$@"; then
        echo "== tier ${name}: passed in $((SECONDS - start)) s"
    else
        echo "== tier ${name}: FAILED (rc $?) in $((SECONDS - start)) s"
        failed+=("${name}")
    fi
}
tier lint .venv/bin/ruff check rlalign_verl tests benchmarks scripts setup.py
tier format .venv/bin/ruff format --check rlalign_verl tests benchmarks scripts setup.py
tier main .venv/bin/python -m pytest tests --durations=25 "$@"
if [ $# -eq 0 ]; then
    # the version matrix (scripts/setup_matrix.sh): what depends on the library versions, on the other versions
    tier matrix bash scripts/test_matrix.sh
    if [ -f scripts/test_openrlhf.sh ]; then
        tier openrlhf bash scripts/test_openrlhf.sh
    fi
fi
if [ ${#failed[@]} -gt 0 ]; then
    echo "test.sh: FAILED tiers: ${failed[*]}"
    exit 1
fi
echo "test.sh: every tier passed"
