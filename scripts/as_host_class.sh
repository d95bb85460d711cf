#!/usr/bin/env bash
# Run a command as a smaller x86 host class than this host's: `bash scripts/as_host_class.sh avx2 CMD...`.
# Classes: avx2 (no AVX512: vLLM's _C_AVX2 build, truncating bf16 stores, no oneDNN bf16 GEMM) and avx512
# (AVX512 without BF16/AMX: vLLM's _C_AVX512 build). The host must have the class's instructions; the run then
# loads the class's kernel builds and takes its ISA paths: ATen's dispatch (ATEN_CPU_CAPABILITY), oneDNN's JIT
# (ONEDNN_MAX_CPU_ISA, which also decides torch's bf16 matmul route), Inductor's -march and torch.cpu's feature queries
# (scripts/host_class/sitecustomize.py, in every Python process of the run). What it cannot change: instructions
# that code picks from CPUID itself outside those (none found in torch, oneDNN's capped JIT or vLLM's CPU build).
# Use it to see a class's failures and timings on any bigger host; the class's own hosts remain the record.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
class=${1:-}
case "${class}" in
avx2) aten=avx2 onednn=AVX2 march=haswell need=avx2 ;;
avx512) aten=avx512 onednn=AVX512_CORE march=skylake-avx512 need=avx512f ;;
*)
    echo "as_host_class.sh: name a class: avx2 or avx512 (then the command to run)" >&2
    exit 2
    ;;
esac
shift
if ! grep -qw "${need}" /proc/cpuinfo; then
    echo "as_host_class.sh: this host has no ${need}; run the ${class} class on a host that has it" >&2
    exit 2
fi
[ $# -gt 0 ] || { echo "as_host_class.sh: give the command to run after the class" >&2; exit 2; }
export RLALIGN_HOST_CLASS=${class} ATEN_CPU_CAPABILITY=${aten} ONEDNN_MAX_CPU_ISA=${onednn}
# Inductor's C++ (ours and the engine's) is built for the class's CPU, not with -march=native; compiled code
# and vLLM's compile artifacts are cached apart from the host's own, so neither run loads the other's
export TORCHINDUCTOR_CPP_MARCH=${march}
cache=${XDG_CACHE_HOME:-${HOME}/.cache}/rlalign-host-class/${class}
export TORCHINDUCTOR_CACHE_DIR=${cache}/inductor VLLM_CACHE_ROOT=${cache}/vllm
export PYTHONPATH="${here}/host_class${PYTHONPATH:+:${PYTHONPATH}}"
exec "$@"
