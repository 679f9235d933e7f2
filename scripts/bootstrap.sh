#!/usr/bin/env bash
# Creates (or refreshes) the project's virtual environment in $VENV (default .venv).
#
# torch: a torch >= 2.9 already importable by $PYTHON is reused (the venv sees the system
# site-packages), so GPU users keep their own build. Otherwise $NOBUBBLE_TORCH is installed
# (default torch==2.13.0: on CPU machines that is the CPU wheel; a bare `torch` would pull CUDA).
# Everything else is pinned by constraints.txt. $EXTRAS (default: dev) names the optional extras
# to install, comma-separated (`make test` asks for all). Re-runs only when those inputs change.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH_SPEC=${NOBUBBLE_TORCH:-torch==2.13.0}
EXTRAS=${EXTRAS:-dev}

if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    echo "bootstrap: $PYTHON is missing or older than Python 3.11; set PYTHON=/path/to/python3.11+" >&2
    exit 1
fi

has_torch() {
    "$1" - <<'PY' 2>/dev/null
import sys
import torch
major, minor = (int(x) for x in torch.__version__.split(".")[:2])
sys.exit(0 if (major, minor) >= (2, 9) else 1)
PY
}

stamp_input=$(cat pyproject.toml constraints.txt; echo "$TORCH_SPEC $EXTRAS"; "$PYTHON" --version)
stamp=$(printf '%s' "$stamp_input" | sha256sum | cut -c1-16)
if [ -f "$VENV/.bootstrap-$stamp" ]; then
    exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
    if has_torch "$PYTHON"; then
        echo "bootstrap: reusing the torch already installed for $PYTHON"
        "$PYTHON" -m venv --system-site-packages "$VENV"
    else
        "$PYTHON" -m venv "$VENV"
    fi
fi
pip=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)
if ! has_torch "$VENV/bin/python"; then
    echo "bootstrap: installing $TORCH_SPEC"
    "${pip[@]}" "$TORCH_SPEC"
fi
echo "bootstrap: installing nobubble and its pinned dependencies into $VENV"
"${pip[@]}" -c constraints.txt -e ".[$EXTRAS]"
rm -f "$VENV"/.bootstrap-*
touch "$VENV/.bootstrap-$stamp"
