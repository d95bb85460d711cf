#!/usr/bin/env bash
# The tests whose expectations depend on the x86 host class (the bf16 store of vLLM's kernel build, its all-reduce,
# oneDNN's and Inductor's ISA), run again as each smaller class this host can take on (scripts/as_host_class.sh):
# on an AMX or AVX512-BF16 host the AVX2 and AVX512-without-BF16 classes, so a change that breaks one is seen on any
# CI host, not only on a host of that class. A class the host already is (its native run covers it) or lacks is
# skipped.
# RLALIGN_HOST_CLASSES: the classes to take on (default "avx2 avx512": AVX2 only, AVX512 without BF16).
# Extra arguments go to pytest.
set -uo pipefail
cd "$(dirname "$0")/.."
export VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 TOKENIZERS_PARALLELISM=false
# every test file that reads the host's class (torch.cpu._is_*) or its kernel builds; tests/test_host_classes.py
# checks the list is complete (the GRPO runs are left out: a GRPO run per class would double the CI time)
FILES=(
    tests/catalog/test_kernel_store.py
    tests/align/test_engine_ops.py
    tests/align/test_regions_exact.py
    tests/align/test_inductor_norm.py
    tests/align/test_profile_mutations.py
    tests/align/test_moe_mutations.py
    tests/align/test_moe_engine_op.py
    tests/align/test_tp_moe.py
    tests/tools/test_moe_engine_ops.py
    tests/tools/test_moe_routes.py
    tests/tools/test_piecewise_probe.py
    tests/tools/test_piecewise_floor.py
    tests/tools/test_gpu_check_script.py
    tests/tools/test_exact_zero_gap.py
    tests/tools/test_tp_engine.py
    tests/tools/test_moe_compiled_norm.py
)
has() { grep -qw "$1" /proc/cpuinfo; }
failed=()
for class in ${RLALIGN_HOST_CLASSES:-avx2 avx512}; do
    case "${class}" in
    avx2) native=$(has avx512f || echo yes); able=$(has avx2 && echo yes) ;;
    avx512) native=$(has avx512f && ! has avx512_bf16 && echo yes); able=$(has avx512f && echo yes) ;;
    *) echo "test_host_classes.sh: unknown class ${class} (avx2, avx512)" >&2; exit 2 ;;
    esac
    if [ -n "${native}" ]; then
        echo "== host class ${class}: this host is of that class; its own run covers it"
        continue
    elif [ -z "${able}" ]; then
        echo "== host class ${class}: this host lacks its instructions; skipped"
        continue
    fi
    echo "== host class ${class}: ${#FILES[@]} files"
    start=$SECONDS
    if bash scripts/as_host_class.sh "${class}" .venv/bin/python -m pytest "${FILES[@]}" -m "not grpo" -q \
        -p no:cacheprovider --durations=5 "$@"; then
        echo "== host class ${class}: passed in $((SECONDS - start)) s"
    else
        echo "== host class ${class}: FAILED in $((SECONDS - start)) s"
        failed+=("${class}")
    fi
done
[ ${#failed[@]} -eq 0 ] || { echo "test_host_classes.sh: FAILED classes: ${failed[*]}"; exit 1; }
