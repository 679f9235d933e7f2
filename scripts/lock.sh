#!/usr/bin/env bash
# Writes locks/pip.txt, locks/all.txt and locks/core.txt, the exact versions and hashes
# scripts/bootstrap.sh installs: `make lock` after a change to pyproject.toml's dependencies; `make lock ARGS=--upgrade`
# moves every pin to the newest release that fits (otherwise a pin moves only when it must).
#
# uv (of the dev extra, or $UV) resolves pyproject.toml for CPython 3.11 on this platform:
# all.txt with every extra (`make test`, `make lint`), core.txt with none (`make train`), held to
# all.txt's versions. Each pin carries the hashes of its files on PyPI. torch itself is left out
# (bootstrap installs it, or reuses a GPU user's build), its own dependencies are in: they are
# resolved against the CPU wheel of locks/torch.txt, which must be on PIP_FIND_LINKS (the CUDA
# build would bring its nvidia-* packages, which a CPU machine does not want and a GPU user has).
# pip.txt pins pip itself: the pip of Python 3.11's venv (23.2) refuses a hashed lock in which a
# package is asked for with an extra (typepy[datetime]), so bootstrap upgrades it first.
set -euo pipefail
cd "$(dirname "$0")/.."
UV=${UV:-.venv/bin/uv}
PYTHON=${PYTHON:-python3}

if [ ! -x "$UV" ]; then
    echo "lock: no uv at $UV; run \`make bootstrap-test\` (the dev extra has it) or set UV=/path/to/uv" >&2
    exit 1
fi
# the build backend too (given on standard input): bootstrap installs nobubble from the lock alone
build=$("$PYTHON" -c 'import sys, tomllib
print("\n".join(tomllib.load(sys.stdin.buffer)["build-system"]["requires"]))' <pyproject.toml)
find_links=()
for folder in ${PIP_FIND_LINKS:-}; do
    find_links+=(--find-links "$folder")
done
compile=("$UV" pip compile --quiet --generate-hashes --python-version 3.11 --no-emit-package torch
    --custom-compile-command "make lock" -c locks/torch.txt "${find_links[@]}")

"${compile[@]}" "$@" - -o locks/pip.txt <<<pip
"${compile[@]}" "$@" --all-extras pyproject.toml - -o locks/all.txt <<<"$build"
"${compile[@]}" "$@" -c locks/all.txt pyproject.toml - -o locks/core.txt <<<"$build"
if grep -q '^nvidia-' locks/all.txt; then
    echo "lock: torch resolved to its CUDA build (nvidia-* in locks/all.txt): put the CPU wheel of" \
        "$(grep -v '^#' locks/torch.txt) in a folder on PIP_FIND_LINKS and run it again" >&2
    exit 1
fi
echo "lock: wrote locks/pip.txt, locks/all.txt ($(grep -c '^[a-z]' locks/all.txt) packages) and" \
    "locks/core.txt ($(grep -c '^[a-z]' locks/core.txt))"
