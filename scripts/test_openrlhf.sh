#!/usr/bin/env bash
# Run the OpenRLHF integration suite (tests/openrlhf) in OpenRLHF's own environment ./.venv-openrlhf
# (built by scripts/setup_openrlhf.sh). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${OPENRLHF_VENV:-.venv-openrlhf}
if [ ! -x "$VENV/bin/python" ]; then
    echo "test_openrlhf: $VENV is missing; run scripts/setup_openrlhf.sh first" >&2
    exit 1
fi
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false RAY_USAGE_STATS_ENABLED=0 RAY_DEDUP_LOGS=0
"$VENV/bin/python" -m pytest tests/openrlhf "$@"
