#!/usr/bin/env bash
# Issue 13's experiment (experiments/corrections.toml): the sweep, a check that main's runs can be
# reused, then the reports, written to docs/results/corrections/<part>/ (report.md and PNGs).
#
#   experiments/corrections.sh          # everything: about 2 h 50 min on 2 quiet cores (an
#                                       # estimate, docs/experiments.md) when runs/paper_cpu
#                                       # holds paper_cpu's runs; about 1 h 50 min more if not
#   JOBS=1 experiments/corrections.sh   # runs at a time (default 2)
#   REUSE_ANYWAY=1 ...                  # go on although repro differs from main (see below)
#
# 1. lr_sweep, main and repro. Where runs/paper_cpu holds paper_cpu's lr_sweep and main they are
#    skipped; repro retrains six of main's runs (seed 0 of adamw and muon: sync, 2bw, 2bw+EF).
# 2. repro against main: the reused runs are only comparable with the new ones if the current
#    code trains them the same way. The final validation losses must be equal; if they are not,
#    this script stops before anything else trains (move runs/paper_cpu's lr_sweep, main,
#    pipedream and longer away to retrain them, or set REUSE_ANYWAY=1 after reading the
#    differences). The same torch version and one torch thread per run (2 jobs on 2 cores, as
#    paper_cpu ran) are part of "the same way".
# 3. Every phase (the finished ones are skipped). noclip_best and longer_best take the best
#    correction of the corrections phase, which the sweep prints.
# 4. The reports, and docs/results/corrections/pipeline_cost/cost.md (time and memory per step).
#
# Stop it whenever you like: running it again skips every finished run. A report whose runs do
# not exist yet is skipped with a message; the exit status is the sweep's.
set -uo pipefail
cd "$(dirname "$0")/.."
NOBUBBLE=${NOBUBBLE:-.venv/bin/nobubble}
PYTHON=${PYTHON:-.venv/bin/python}
GRID=experiments/corrections.toml
RUNS=runs/paper_cpu
DOCS=docs/results/corrections

"$NOBUBBLE" sweep --config "$GRID" --jobs "${JOBS:-2}" --phase lr_sweep --phase main --phase repro ||
    { echo "corrections.sh: lr_sweep, main or repro failed; fix that first" >&2; exit 1; }

"$PYTHON" - "$RUNS" <<'EOF' || [ "${REUSE_ANYWAY:-0}" = 1 ] || exit 1
import json, sys
from pathlib import Path
runs = Path(sys.argv[1])
different = 0
for repro in sorted((runs / "repro").iterdir()):
    if not (repro / "summary.json").is_file():
        continue
    main = runs / "main" / repro.name
    new = json.loads((repro / "summary.json").read_text())["final_val_loss"]
    old = json.loads((main / "summary.json").read_text())["final_val_loss"]
    same = new == old
    different += not same
    print(f"repro {repro.name}: {new!r} vs main {old!r}{'' if same else f'  DIFFERENT by {new - old:+.2e}'}")
if different:
    print(f"corrections.sh: {different} of main's runs train differently with the current code; "
          "their sync, 2bw and 2bw+EF runs cannot be reused as they are (see the script's header)",
          file=sys.stderr)
    sys.exit(1)
print("corrections.sh: repro equals main: main's runs are reused")
EOF

"$NOBUBBLE" sweep --config "$GRID" --jobs "${JOBS:-2}"
status=$?

report() {  # report PART TITLE ARGS...
    local part=$1 title=$2
    shift 2
    "$NOBUBBLE" report "$@" --out "$DOCS/$part" --title "$title" ||
        echo "corrections.sh: no $part report yet (see the error above)" >&2
}
second=()  # the phase to fill in at the end of the grid, once it exists
[ -d "$RUNS/second" ] && second=("$RUNS/second")

report corrections "Delay corrections under 2bw, seven optimizers" \
    "$RUNS/main" "$RUNS/corrections"
report momentum "Momentum: Muon nesterov on/off, NAdamW beta1 0.9/0.99, each with and without EF" \
    "$RUNS/main" "$RUNS/momentum" --where optim=muon,nadamw
report ef_gamma "EF strength gamma in {0.5, beta, 1, 1.5}" \
    "$RUNS/main" "$RUNS/ef_gamma" --where optim=adamw,muon,nadamw --vs ef_gamma
report pipedream "PipeDream (4 and 8 stages) with spike and predict" \
    "$RUNS/main" "$RUNS/pipedream" "$RUNS/pipedream_corr" --where optim=adamw,muon --where ef=false
report noclip "Gradient clipping off (grad_clip 0) and on (1.0): EF and the best corrections" \
    "$RUNS/main" "$RUNS/corrections" "$RUNS/noclip" "$RUNS/noclip_best" ${second[@]+"${second[@]}"} \
    --where optim=adamw,muon --where steps=300
report longer "300 vs 1,200 steps: EF and the best corrections" \
    "$RUNS/main" "$RUNS/corrections" "$RUNS/longer" "$RUNS/longer_best" ${second[@]+"${second[@]}"} \
    --where optim=adamw,muon --where grad_clip=1.0
report pipeline_cost "Each correction on the 2-stage pipeline under torchrun (2bw, 4 microbatches)" \
    "$RUNS/pipeline_cost"

# Time and memory per step on the pipeline, from each run's summary.json.
mkdir -p "$DOCS/pipeline_cost"
"$PYTHON" - "$RUNS/pipeline_cost" > "$DOCS/pipeline_cost/cost.md" <<'EOF' ||
import json, sys
from pathlib import Path
print("| optimizer | correction | s/step (training) | tokens/s | weight versions, stage 0 / 1 "
      "| peak memory MB, stage 0 / 1 |")
print("|---|---|---|---|---|---|")
for run in sorted(Path(sys.argv[1]).iterdir()):
    if not (run / "summary.json").is_file():
        continue
    s = json.loads((run / "summary.json").read_text())
    c = json.loads((run / "config.json").read_text())
    stages = s.get("stages", [])
    versions = " / ".join(str(st.get("weight_versions_peak")) for st in stages)
    memory = " / ".join(f"{st.get('peak_mem_mb', float('nan')):.0f}" for st in stages)
    print(f"| {c['optim']} | {c.get('correction', 'none')} | {s['train_s'] / s['steps']:.4f} "
          f"| {s['tokens_per_s']:,.0f} | {versions} | {memory} |")
EOF
    echo "corrections.sh: no pipeline_cost table yet" >&2
exit $status
