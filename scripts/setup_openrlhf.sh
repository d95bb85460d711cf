#!/usr/bin/env bash
# Build OpenRLHF's separate CPU test environment ./.venv-openrlhf (OpenRLHF 0.11.2 at its own pins,
# locked in constraints/openrlhf.txt) with rlalign-verl installed editable.
# Idempotent: a stamp of the inputs makes a re-run with nothing changed return at once.
# Env: PYTHON (interpreter for the venv, default python3), OPENRLHF_VENV (default .venv-openrlhf).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${OPENRLHF_VENV:-.venv-openrlhf}
PY=${PYTHON:-python3}
LOCK=constraints/openrlhf.txt
STAMP="$VENV/.rlalign-setup-stamp"
start=$(date +%s)

want=$(cat "$LOCK" scripts/setup_openrlhf.sh pyproject.toml | sha256sum | cut -c1-16)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] \
    && "$VENV/bin/python" -c "import importlib.util as u; assert all(u.find_spec(m) for m in \
        ('torch', 'transformers', 'ray', 'openrlhf', 'deepspeed', 'flash_attn', 'pytest', 'rlalign_verl'))" \
        >/dev/null 2>&1; then
    echo "setup_openrlhf: $VENV is up to date"
    exit 0
fi
rm -f "$STAMP"

if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
pipi() { "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@"; }

pipi -c "$LOCK" pip setuptools wheel
# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
pipi -c "$LOCK" "torch==2.13.0"
# DeepSpeed and flash-attn build from source against that torch: DeepSpeed without its C++/CUDA ops
# (pure Python, imports on CPU), flash-attn Python-only (its CUDA extension is skipped; importing it
# on CPU needs a stub `flash_attn_2_cuda` module, which only the tests provide).
DS_BUILD_OPS=0 pipi -c "$LOCK" --no-build-isolation deepspeed packaging psutil ninja
FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE FLASH_ATTENTION_FORCE_BUILD=TRUE \
    pipi -c "$LOCK" --no-build-isolation --no-deps flash-attn
# OpenRLHF with its own dependencies (vLLM, a CUDA-only extra, is left out), the test runner, and us.
pipi -c "$LOCK" openrlhf pytest
# (the build backend's deprecation chatter goes to a log; shown only if the install fails)
pipi -c "$LOCK" --no-build-isolation -e . >"$VENV/.editable-install.log" 2>&1 \
    || { cat "$VENV/.editable-install.log" >&2; exit 1; }
# Some dependency updates may bring CUDA builds of these back; they break imports on CPU.
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true

"$VENV/bin/python" -c "import torch, transformers, ray, openrlhf, deepspeed; \
print('setup_openrlhf: torch', torch.__version__, 'transformers', transformers.__version__, \
'ray', ray.__version__, 'deepspeed', deepspeed.__version__)" 2>/dev/null
echo "$want" > "$STAMP"
echo "setup_openrlhf: done in $(( $(date +%s) - start ))s"
