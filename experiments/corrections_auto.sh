#!/usr/bin/env bash
# Issue 28's goal (experiments/corrections_auto.toml): correction=auto against sync and 2bw for
# AdamW and Muon on seeds the corrections study did not tune on, at 300 and 1,200 steps; the
# reports (docs/results/corrections_auto/<part>/) and the run records.
#
#   experiments/corrections_auto.sh              # 30 runs (docs/results.md section 15)
#   JOBS=1 experiments/corrections_auto.sh       # runs at a time (default 2)
#
# As experiments/corrections.sh: the records of finished runs are kept in git
# (docs/results/corrections_auto/runs.tar.xz), added to runs/corrections_auto before the sweep
# and packed again after it; running it again skips every finished run.
set -uo pipefail
cd "$(dirname "$0")/.."
NOBUBBLE=${NOBUBBLE:-.venv/bin/nobubble}
RUNS=runs/corrections_auto
DOCS=docs/results/corrections_auto
RECORDS=$DOCS/runs.tar.xz

[ -f "$RECORDS" ] && experiments/run_records.sh unpack "$RECORDS" "$RUNS"

"$NOBUBBLE" sweep --config experiments/corrections_auto.toml --jobs "${JOBS:-2}" "$@"
status=$?

report() {  # report PART TITLE ARGS...
    local part=$1 title=$2
    shift 2
    "$NOBUBBLE" report "$@" --out "$DOCS/$part" --title "$title" ||
        echo "corrections_auto.sh: no $part report yet (see the error above)" >&2
}

report goal "correction=auto at 300 steps, seeds 3-5" "$RUNS/goal"
report goal_longer "correction=auto at 1,200 steps, seeds 3-4" "$RUNS/goal_longer"

[ -d "$RUNS" ] && mkdir -p "$DOCS" && experiments/run_records.sh pack "$RUNS" "$RECORDS"
exit $status
