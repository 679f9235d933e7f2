#!/usr/bin/env bash
# Issues 13 and 28's experiment (experiments/corrections.toml): the sweep, a check of its main
# phase against paper_cpu's, the reports (docs/results/corrections/<part>/) and the run records.
#
#   experiments/corrections.sh                   # everything (563 runs; docs/experiments.md)
#   experiments/corrections.sh --phase controls --phase momentum_comp   # round two, in parts
#   experiments/corrections.sh --phase main      # extra arguments go to `nobubble sweep`
#   JOBS=1 experiments/corrections.sh            # runs at a time (default 2)
#
# The records of finished runs (config.json, summary.json, metrics.jsonl: no checkpoints) are
# kept in git, in docs/results/corrections/runs.tar.xz: this script first adds the ones
# runs/corrections lacks, so that a fresh clone goes on where the last machine stopped, and
# packs every finished run into it again at the end. Stop it whenever you like: running it
# again skips every finished run. A report whose runs do not exist yet is skipped with a message;
# the exit status is the sweep's.
set -uo pipefail
cd "$(dirname "$0")/.."
NOBUBBLE=${NOBUBBLE:-.venv/bin/nobubble}
RUNS=runs/corrections
DOCS=docs/results/corrections
RECORDS=$DOCS/runs.tar.xz

[ -f "$RECORDS" ] && experiments/run_records.sh unpack "$RECORDS" "$RUNS"

"$NOBUBBLE" sweep --config experiments/corrections.toml --jobs "${JOBS:-2}" "$@"
status=$?

report() {  # report PART TITLE ARGS...
    local part=$1 title=$2
    shift 2
    "$NOBUBBLE" report "$@" --out "$DOCS/$part" --title "$title" ||
        echo "corrections.sh: no $part report yet (see the error above)" >&2
}

report main "Sync vs 2bw vs 2bw+EF at the best sync learning rate" "$RUNS/main"
# main is paper_cpu's main phase again: the same settings give the same table on the same torch
# and CPU kind; another machine may differ within seed noise. Shown, not enforced.
if [ -f "$DOCS/main/report.md" ]; then
    table() { sed -n '/^## Final validation loss/,/^Final validation loss/p' "$1" | grep '^| [a-z]' | grep -v '^| optimizer'; }
    if diff <(table docs/results/paper_cpu/main/report.md) <(table "$DOCS/main/report.md") \
        > /dev/null; then
        echo "corrections.sh: main reproduces paper_cpu's main table exactly"
    else
        echo "corrections.sh: main differs from paper_cpu's main table (left: paper_cpu):"
        diff <(table docs/results/paper_cpu/main/report.md) <(table "$DOCS/main/report.md")
    fi
fi
report corrections "Delay corrections under 2bw" "$RUNS/main" "$RUNS/corrections"
report momentum "Momentum: Muon nesterov on/off, NAdamW beta1 0.9/0.99 (and NAdam's warm-up), each with and without EF" \
    "$RUNS/main" "$RUNS/momentum" --where optim=muon,nadamw
report ef_gamma "EF strength gamma in {0.5, beta, 1, 1.5}" \
    "$RUNS/main" "$RUNS/ef_gamma" --where optim=adamw,muon,nadamw --vs ef_gamma
report ef_strong "EF at gamma 2, and gamma 1.5 with predict, beside gamma 0.5 to 1.5" \
    "$RUNS/main" "$RUNS/ef_gamma" "$RUNS/ef_strong" --where optim=adamw,muon
report noclip "Gradient clipping off (grad_clip 0) and on (1.0): EF and the best correction" \
    "$RUNS/main" "$RUNS/corrections" "$RUNS/noclip" "$RUNS/noclip_best" --where optim=adamw,muon
report pipedream "PipeDream (4 and 8 stages) with spike and predict" \
    "$RUNS/main" "$RUNS/pipedream" "$RUNS/pipedream_corr" --where optim=adamw,muon --where ef=false
report longer "300 vs 1,200 steps: EF and the best correction" \
    "$RUNS/main" "$RUNS/corrections" "$RUNS/longer" "$RUNS/longer_best" --where optim=adamw,muon
report pipeline_cost "Each correction on the 2-stage pipeline under torchrun (2bw, 4 microbatches)" \
    "$RUNS/pipeline_cost"
# round two (issue 28)
report controls "Each correction under sync (its control) beside its 2bw run" \
    "$RUNS/main" "$RUNS/corrections" "$RUNS/ef_gamma" "$RUNS/ef_strong" "$RUNS/controls" \
    --where optim=adamw,muon
report momentum_comp "The momentum view: AdamW's beta1 and Muon's momentum lowered, alone and with EF" \
    "$RUNS/main" "$RUNS/gamma_all" "$RUNS/momentum_comp" --where optim=adamw,muon \
    --vs beta1 momentum --reference beta1=0.9 --reference momentum=0.95
report gamma_all "EF's gamma per optimizer: AdamW 1.5-3, Muon 1.25-2" \
    "$RUNS/main" "$RUNS/gamma_all" --where optim=adamw,muon --vs ef_gamma
report longer_round2 "1,200 steps: EF at its best gamma; Muon at momentum 0.9 with EF, beside sync and 2bw at 0.9" \
    "$RUNS/longer" "$RUNS/longer_best" "$RUNS/longer_gamma" "$RUNS/longer_momentum_muon" \
    --where optim=adamw,muon --vs ef_gamma momentum --reference momentum=0.95
report momentum_up "AdamW's beta1 raised to 0.95 under EF (gamma 2 and 3)" \
    "$RUNS/main" "$RUNS/gamma_all" "$RUNS/momentum_up" --where optim=adamw --vs beta1 \
    --reference beta1=0.9
for optim_lr in adamw=0.003 muon=0.01; do  # each optimizer's learning rate tuned under sync
    report "lr_comp_${optim_lr%=*}" "The learning-rate view (${optim_lr%=*}): the delayed run at a smaller learning rate, alone and with EF" \
        "$RUNS/main" "$RUNS/gamma_all" "$RUNS/lr_comp" --where "optim=${optim_lr%=*}" --vs lr \
        --reference "lr=${optim_lr#*=}"
done
report staleness "Weight drift and gradient cosine of every correction under 2bw (seed 0)" \
    "$RUNS/staleness"
report others "The other five optimizers: controls and EF's gamma" \
    "$RUNS/main" "$RUNS/corrections" "$RUNS/controls_others" "$RUNS/gamma_others" \
    --where optim=lion,adan,soap,mars,nadamw --vs ef_gamma
report momentum_others "The other five optimizers: their momentum lowered, alone and with EF" \
    "$RUNS/main" "$RUNS/momentum_others" --where optim=lion,adan,soap,mars,nadamw \
    --vs beta1 beta2 --reference beta1=0.9 --reference beta2=0.95

# Time and memory per step on the pipeline, from each run's summary.json.
if [ -d "$RUNS/pipeline_cost" ]; then
    mkdir -p "$DOCS/pipeline_cost"
    .venv/bin/python - "$RUNS/pipeline_cost" > "$DOCS/pipeline_cost/cost.md" <<'PY'
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
PY
fi

[ -d "$RUNS" ] && experiments/run_records.sh pack "$RUNS" "$RECORDS"
exit $status
