#!/usr/bin/env bash
# The paper_cpu experiment (experiments/paper_cpu.toml): the sweep, then its reports, written to
# docs/results/paper_cpu/<part>/ (report.md and PNGs).
#
#   experiments/paper_cpu.sh                    # everything: about 1 h 55 min on 2 quiet cores
#   experiments/paper_cpu.sh --phase lr_sweep   # extra arguments go to `nobubble sweep`
#   JOBS=1 experiments/paper_cpu.sh             # runs at a time (default 2)
#
# Stop it whenever you like: running it again skips every finished run. A report whose runs do
# not exist yet is skipped with a message; the exit status is the sweep's.
set -uo pipefail
cd "$(dirname "$0")/.."
NOBUBBLE=${NOBUBBLE:-.venv/bin/nobubble}
RUNS=runs/paper_cpu
DOCS=docs/results/paper_cpu

"$NOBUBBLE" sweep --config experiments/paper_cpu.toml --jobs "${JOBS:-2}" "$@"
status=$?

report() {  # report PART TITLE ARGS...
    local part=$1 title=$2
    shift 2
    "$NOBUBBLE" report "$@" --out "$DOCS/$part" --title "$title" ||
        echo "paper_cpu.sh: no $part report yet (see the error above)" >&2
}

report lr_sweep "Learning rate per optimizer (sync, seed 0)" "$RUNS/lr_sweep" --vs lr
report main "Sync vs 2bw vs 2bw+EF at the best sync learning rate" "$RUNS/main"
report pipedream "PipeDream (4 and 8 stages) vs 2bw" "$RUNS/main" "$RUNS/pipedream" \
    --where optim=adamw,muon --where ef=false
report ablation "Momentum ablation: muon momentum, adamw beta1" "$RUNS/main" "$RUNS/ablation" \
    --where optim=adamw,muon --where ef=false --vs momentum beta1
report time_to_target "Time to target: 1f1b vs 2bw+EF, 2-stage pipeline under torchrun" \
    "$RUNS/time_to_target" --time-to-target
report muon_lr_edge "Muon one learning rate beyond the grid: 1e-2 vs 3e-2" \
    "$RUNS/main" "$RUNS/muon_lr_edge" --where optim=muon
report longer "300 vs 1,200 steps: does the delay gap shrink in a longer run?" \
    "$RUNS/main" "$RUNS/longer" --where optim=adamw,muon
exit $status
