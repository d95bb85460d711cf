#!/usr/bin/env bash
# The GPU check as one command on the lent GPU machine (no vLLM, SGLang or FlashInfer, no network), from
# the bundle that `python scripts/gpu_bundle.py` makes here (docs/gpu-check.md):
#   1. verify the bundle against its MANIFEST (sha256 of every file); one line and exit 2 if it is
#      missing or changed, before anything is built;
#   2. build vLLM's kernels and FlashInfer's norm/RoPE kernels from it for this GPU only
#      (scripts/gpu_bundle_build.py, both at once);
#   3. every row of scripts/gpu_profile_check.py in bundle mode (vllm-eager vs the built kernels, vllm vs
#      the bundled native ops under Inductor with vLLM's settings, sglang vs FlashInfer, the Triton rows,
#      the MoE router) -> $OUT/gpu_check.json;
#   4. the end-to-end floor step (compiled and eager floors) -> $OUT/gpu_check_e2e.json;
#   5. a compact summary (scripts/gpu_check_summary.py): every miss with its best rounding variant.
# Exit 0: every row passes; 1: a miss, a failed build or a step that crashed/ran out of time; 2: no usable
# bundle or no CUDA device. Usage, from the repository root: bash scripts/gpu_device_check.sh [--full]
# (--full: all five hidden sizes instead of the smallest and largest). Each step gets a share of
# GPU_CHECK_BUDGET_S (default 470 s), so the whole command ends inside 8 minutes.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
bundle=${GPU_BUNDLE:-gpu_bundle}
out=${OUT:-/tmp/gpu-check-out}
py=${PYTHON:-python3}
budget=${GPU_CHECK_BUDGET_S:-470}
rows_args=(--quick)
[ "${1:-}" = "--full" ] && rows_args=()
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 # no network there: never wait for one
export RLALIGN_GPU_BUILD=${RLALIGN_GPU_BUILD:-/tmp/rlalign_gpu_build}

"$py" scripts/gpu_bundle.py --verify "$bundle" || exit 2
if ! "$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_device_check: no CUDA device (or no torch) for $py: torch.cuda.is_available() is not True" >&2
    exit 2
fi
if [ -z "${CUDA_HOME:-}" ] && command -v nvcc >/dev/null; then
    CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
    export CUDA_HOME
fi
mkdir -p "$out"
"$py" -c 'import torch; print(f"gpu_device_check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")'
nvcc --version | tail -n 2

share() { # seconds left of the budget after keeping $1 for later steps (at least 30)
    local s=$((budget - SECONDS - $1))
    [ "$s" -lt 30 ] && s=30
    echo "$s"
}

# 2. both extensions at once (ninja runs each one's sources in parallel)
timeout 240 "$py" scripts/gpu_bundle_build.py --bundle "$bundle" --only vllm >"$out/build_vllm.log" 2>&1 &
pid_vllm=$!
timeout 240 "$py" scripts/gpu_bundle_build.py --bundle "$bundle" --only flashinfer >"$out/build_flashinfer.log" 2>&1 &
pid_fi=$!
wait "$pid_vllm"
rc_vllm=$?
wait "$pid_fi"
rc_fi=$?
if [ "$rc_vllm" -ne 0 ]; then
    tail -n 40 "$out/build_vllm.log"
    echo "gpu_device_check: FAIL: vLLM's kernels did not build (rc $rc_vllm; build_vllm.log)"
    exit 1
fi
if [ "$rc_fi" -ne 0 ]; then
    tail -n 15 "$out/build_flashinfer.log"
    echo "gpu_device_check: FlashInfer did not build (rc $rc_fi): the sglang rows are absent (build_flashinfer.log)"
fi
echo "gpu_device_check: kernels built in ${SECONDS} s"

# 3. the rows (leave 150 s for the e2e step), 4. the e2e step
timeout "$(share 150)" "$py" scripts/gpu_profile_check.py --bundle "$bundle" --no-e2e ${rows_args[@]+"${rows_args[@]}"} \
    --out "$out/gpu_check.json" 2>"$out/rows.err"
rc_rows=$?
[ "$rc_rows" -gt 1 ] && tail -n 25 "$out/rows.err"
echo "gpu_device_check: rows step rc $rc_rows at ${SECONDS} s"
timeout "$(share 10)" "$py" scripts/gpu_profile_check.py --bundle "$bundle" --e2e-only \
    --profiles vllm,vllm-eager --out "$out/gpu_check_e2e.json" 2>"$out/e2e.err"
rc_e2e=$?
[ "$rc_e2e" -gt 1 ] && tail -n 25 "$out/e2e.err"
echo "gpu_device_check: e2e step rc $rc_e2e at ${SECONDS} s"

# 5. the summary decides (a missing report, e.g. a step that timed out, is a failure)
"$py" scripts/gpu_check_summary.py "$out/gpu_check.json" "$out/gpu_check_e2e.json"
rc_sum=$?
if [ "$rc_rows" -ne 0 ] || [ "$rc_e2e" -ne 0 ] || [ "$rc_sum" -ne 0 ]; then
    exit 1
fi
exit 0
