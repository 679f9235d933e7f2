#!/usr/bin/env bash
# Issue 40's blockwise Muon under the one-step delay (experiments/blockwise_muon.toml): Muon at
# muon_blocks 1, 2, 4 under sync, 2bw and 2bw+auto, seeds 0 and 1; the report
# (docs/results/blockwise_muon/) and the run records.
#
#   experiments/blockwise_muon.sh              # 18 runs (docs/results.md section 17)
#   JOBS=2 experiments/blockwise_muon.sh       # runs at a time (default 1)
#
# As experiments/corrections_auto.sh: the records of finished runs are kept in git
# (docs/results/blockwise_muon/runs.tar.xz), added to runs/blockwise_muon before the sweep and
# packed again after it; running it again skips every finished run.
set -uo pipefail
cd "$(dirname "$0")/.."
NOBUBBLE=${NOBUBBLE:-.venv/bin/nobubble}
RUNS=runs/blockwise_muon
DOCS=docs/results/blockwise_muon
RECORDS=$DOCS/runs.tar.xz

[ -f "$RECORDS" ] && experiments/run_records.sh unpack "$RECORDS" "$RUNS"

"$NOBUBBLE" sweep --config experiments/blockwise_muon.toml --jobs "${JOBS:-1}" "$@"
status=$?

"$NOBUBBLE" report "$RUNS" --out "$DOCS" --title "Blockwise Muon under the one-step delay" ||
    echo "blockwise_muon.sh: no report yet (see the error above)" >&2

[ -d "$RUNS" ] && mkdir -p "$DOCS" && experiments/run_records.sh pack "$RUNS" "$RECORDS"
exit $status
