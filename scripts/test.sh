#!/usr/bin/env bash
# Run the whole test suite: lint, the main suite, the version matrix, OpenRLHF's suite (its own environment) and the
# host-class-dependent tests again as the AVX2 and AVX512-without-BF16 classes where this host has more
# (scripts/test_host_classes.sh).
# Every tier runs even when an earlier one fails (one red test must not hide the others); the script fails at
# the end, naming each tier that failed. Two lanes run side by side (RLALIGN_TEST_LANES=1: one after the other):
# the main suite without the GRPO runs, and the GRPO runs (-m grpo) followed by the version matrix and OpenRLHF's
# suite; a GRPO run mostly waits on process starts, so the lanes share the machine's cores well.
# Extra arguments go to the main suite's pytest (one lane, the other tiers skipped).
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
second_lane() {  # GRPO runs, version matrix, OpenRLHF's suite, the AVX2 class; "LANE-FAILED <tier>" lines last
    tier grpo .venv/bin/python -m pytest tests -m grpo --durations=10
    tier matrix bash scripts/test_matrix.sh
    if [ -f scripts/test_openrlhf.sh ]; then
        tier openrlhf bash scripts/test_openrlhf.sh
    fi
    tier class-avx2 env RLALIGN_HOST_CLASSES=avx2 bash scripts/test_host_classes.sh
    for name in "${failed[@]}"; do echo "LANE-FAILED ${name}"; done
}
main_lane() {  # the main suite, then the AVX512-without-BF16 class (the lanes take about as long)
    tier main .venv/bin/python -m pytest tests -m "not grpo" --durations=25
    tier class-avx512 env RLALIGN_HOST_CLASSES=avx512 bash scripts/test_host_classes.sh
}
start=$SECONDS
tier lint .venv/bin/ruff check rlalign_verl tests benchmarks scripts setup.py
tier format .venv/bin/ruff format --check rlalign_verl tests benchmarks scripts setup.py
if [ $# -gt 0 ]; then
    tier main .venv/bin/python -m pytest tests --durations=25 "$@"
elif [ "${RLALIGN_TEST_LANES:-2}" = 1 ]; then
    main_lane
    second_lane
else
    lane_log=$(mktemp "${TMPDIR:-/tmp}/rlalign-lane2.XXXXXX")
    (failed=() && second_lane) >"${lane_log}" 2>&1 &  # the lane names only its own failed tiers
    lane_pid=$!
    main_lane
    wait "${lane_pid}"
    echo "== the second lane (GRPO runs, version matrix, OpenRLHF, the AVX2 class), run alongside:"
    cat "${lane_log}"
    while read -r word name; do
        [ "${word}" = LANE-FAILED ] && failed+=("${name}")
    done < <(grep '^LANE-FAILED ' "${lane_log}")
    rm -f "${lane_log}"
fi
echo "test.sh: $((SECONDS - start)) s"
if [ ${#failed[@]} -gt 0 ]; then
    echo "test.sh: FAILED tiers: ${failed[*]}"
    exit 1
fi
echo "test.sh: every tier passed"
