#!/usr/bin/env bash
# Creates (or refreshes) the project's virtual environment in $VENV (default .venv) from a lock of
# scripts/lock.sh: LOCK=core (the default, `make train`) holds nobubble's own dependencies,
# LOCK=all (`make test`, `make lint`) those of every optional extra too.
#
# torch: a torch >= 2.9 already importable by $PYTHON is reused (the venv sees the system
# site-packages), so GPU users keep their own build. Otherwise $NOBUBBLE_TORCH is installed
# (default: locks/torch.txt's torch==2.13.0; on CPU machines the CPU wheel, where a bare `torch`
# would pull CUDA), without its dependencies, which the lock has. torch is the one package
# installed without a hash check: the lock's hashes are PyPI's files', and the torch of a machine
# is a build of its own (a CPU wheel from a local folder or PyTorch's index, a CUDA build).
# Everything else is installed from the lock with --require-hashes, then nobubble itself with
# --no-index: a lock that lacks something pyproject.toml asks for fails here (`make lock` writes a
# new one) rather than bringing it unchecked. Re-runs only when those inputs change.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
LOCK=${LOCK:-core}
TORCH_SPEC=${NOBUBBLE_TORCH:-$(grep -v '^#' locks/torch.txt)}

if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    echo "bootstrap: $PYTHON is missing or older than Python 3.11; set PYTHON=/path/to/python3.11+" >&2
    exit 1
fi
case $LOCK in
    core) extras="" ;;
    all) extras="[$("$PYTHON" -c 'import sys, tomllib
print(",".join(tomllib.load(sys.stdin.buffer)["project"]["optional-dependencies"]))' < pyproject.toml)]" ;;
    *)
        echo "bootstrap: LOCK=$LOCK names no lock; use LOCK=core (make train) or LOCK=all (make test)" >&2
        exit 1
        ;;
esac

has_torch() {
    "$1" - <<'PY' 2>/dev/null
import sys
import torch
major, minor = (int(x) for x in torch.__version__.split(".")[:2])
sys.exit(0 if (major, minor) >= (2, 9) else 1)
PY
}

stamp_input=$(cat pyproject.toml locks/pip.txt "locks/$LOCK.txt"; echo "$TORCH_SPEC"; "$PYTHON" --version)
stamp=$(printf '%s' "$stamp_input" | sha256sum | cut -c1-16)
if [ -f "$VENV/.bootstrap-$LOCK-$stamp" ]; then
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
"${pip[@]}" --require-hashes -r locks/pip.txt  # a pip that takes the locks (scripts/lock.sh)
if ! has_torch "$VENV/bin/python"; then
    echo "bootstrap: installing $TORCH_SPEC"
    "${pip[@]}" --no-deps "$TORCH_SPEC"
fi
echo "bootstrap: installing locks/$LOCK.txt (hash-checked) and nobubble$extras into $VENV"
"${pip[@]}" --require-hashes -r "locks/$LOCK.txt"
if ! "${pip[@]}" --no-index --no-build-isolation -e ".$extras"; then
    echo "bootstrap: locks/$LOCK.txt lacks a package pyproject.toml asks for (above); run" \
        "\`make lock\` to write the locks anew" >&2
    exit 1
fi
if ! "$VENV/bin/python" -m pip check; then
    if grep -q "include-system-site-packages = true" "$VENV/pyvenv.cfg"; then
        echo "bootstrap: warning: pip check found the conflicts above (packages of $PYTHON's" \
            "site-packages are seen too)" >&2
    else
        echo "bootstrap: pip check found the conflicts above: run \`make lock\`" >&2
        exit 1
    fi
fi
rm -f "$VENV/.bootstrap-$LOCK-"*
touch "$VENV/.bootstrap-$LOCK-$stamp"
