#!/usr/bin/env bash
# Issue 35's scaling ladder (experiments/scaling.toml): sync, 2bw and 2bw with correction=auto,
# AdamW and Muon, over a length ladder and a size ladder on the English corpus; then the
# scaling report (the fitted laws, the plots, the paper's check) and the run records.
#
#   experiments/scaling.sh                    # every phase, resumable (skips finished runs)
#   experiments/scaling.sh --phase length     # one phase (repeatable)
#   JOBS=1 experiments/scaling.sh             # runs at a time (default 2)
#
# The corpus is built first when corpora/english-v1 is missing (Debian packages; see
# docs/data.md) and checked against the committed manifest; the records of finished runs are
# kept in git (docs/results/scaling/runs.tar.xz), added to runs/scaling before the sweep and
# packed again after it.
set -uo pipefail
cd "$(dirname "$0")/.."
NOBUBBLE=${NOBUBBLE:-.venv/bin/nobubble}
PYTHON=${PYTHON:-.venv/bin/python}
RUNS=runs/scaling
DOCS=docs/results/scaling
RECORDS=$DOCS/runs.tar.xz
CORPUS=corpora/english-v1

if [ ! -f "$CORPUS/manifest.json" ]; then
    "$PYTHON" -m nobubble.data.english "$CORPUS" || exit 1
fi
# the same corpus as the recorded runs: the manifests agree but for the command that built them
"$PYTHON" - "$CORPUS/manifest.json" experiments/corpus/english-v1/manifest.json <<'PY' || exit 1
import json, sys
built, recorded = (json.load(open(p)) for p in sys.argv[1:])
built.pop("command", None), recorded.pop("command", None)
if built != recorded:
    sys.exit(f"scaling.sh: {sys.argv[1]} is not the recorded english-v1 ({sys.argv[2]}): "
             "rebuild it in an empty folder, or name a new corpus")
PY

[ -f "$RECORDS" ] && experiments/run_records.sh unpack "$RECORDS" "$RUNS"

"$NOBUBBLE" sweep --config experiments/scaling.toml --jobs "${JOBS:-2}" "$@"
status=$?

# the fit, its plots, the study's check, each phase's table and the shipped laws
experiments/scaling_fit.sh "$RUNS" "$DOCS" src/nobubble/delay_laws.json ||
    echo "scaling.sh: no scaling report yet (see the error above)" >&2

[ -d "$RUNS" ] && mkdir -p "$DOCS" && experiments/run_records.sh pack "$RUNS" "$RECORDS"
exit $status
