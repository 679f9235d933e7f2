#!/usr/bin/env bash
# Issue 15's experiment (experiments/moe.toml): the sweep, the reports (docs/results/moe/), the
# routing tables and the run records.
#
#   experiments/moe.sh                  # everything (30 runs; about 1 h with 2 jobs)
#   JOBS=1 experiments/moe.sh           # runs at a time (default 2)
#
# The dense references are the corrections experiment's main phase (runs/corrections/main): its
# records are unpacked from docs/results/corrections/runs.tar.xz, and experiments/corrections.sh
# --phase main trains any that are missing. The MoE runs' records (config.json, summary.json,
# metrics.jsonl) are kept in docs/results/moe/runs.tar.xz; a fresh clone goes on from them.
set -uo pipefail
cd "$(dirname "$0")/.."
NOBUBBLE=${NOBUBBLE:-.venv/bin/nobubble}
PYTHON=${PYTHON:-.venv/bin/python}
RUNS=runs/moe
DENSE=runs/corrections/main
DOCS=docs/results/moe

[ -f "$DOCS/runs.tar.xz" ] && experiments/run_records.sh unpack "$DOCS/runs.tar.xz" "$RUNS"
[ -f docs/results/corrections/runs.tar.xz ] &&
    experiments/run_records.sh unpack docs/results/corrections/runs.tar.xz runs/corrections

"$NOBUBBLE" sweep --config experiments/moe.toml --jobs "${JOBS:-2}" "$@"
status=$?

"$NOBUBBLE" report "$DENSE" "$RUNS/main" "$RUNS/bias" --where optim=adamw,muon \
    --out "$DOCS/report" --title "Dense vs MoE (aux loss, bias balancing): sync, 2bw, 2bw+EF" ||
    echo "moe.sh: no report yet (see the error above)" >&2
"$PYTHON" experiments/moe_routing.py "$RUNS/main" "$RUNS/bias" --out "$DOCS/routing" ||
    echo "moe.sh: no routing tables yet (see the error above)" >&2
experiments/run_records.sh pack "$RUNS" "$DOCS/runs.tar.xz"
exit $status
