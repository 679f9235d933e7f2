#!/usr/bin/env bash
# The scaling ladder's reports (issue 35), from its runs: the fit (DOCS/fit: scaling.md with the
# laws, the penalty table and the study's check, laws.json, the plots), each ladder phase's table
# with the applied-step error (DOCS/PHASE), and a copy of the laws to LAWS, the file
# `nobubble plan --optim` reads by default. experiments/scaling.sh runs it after its sweep;
# tests/test_delay_laws_shipped.py runs it on the committed records and compares LAWS with the
# shipped src/nobubble/delay_laws.json.
#
#   experiments/scaling_fit.sh RUNS DOCS LAWS
#
# The phases fitted are the length ladder and the size ladder's (lr_s* tune the learning rate
# and are not ladder points). The study's 360 M token count is not in the text we could read
# (docs/results.md, section 16): 7.2 B is 20 tokens per parameter, an assumption.
set -euo pipefail
[ $# -eq 3 ] || { sed -n 9p "$0" >&2; exit 2; }
runs=$1 docs=$2 laws=$3
NOBUBBLE=${NOBUBBLE:-.venv/bin/nobubble}
phases=()
for phase in length size_s2 size_s3 size_s4; do
    [ -d "$runs/$phase" ] && phases+=("$phase")
done
[ ${#phases[@]} -gt 0 ] || { echo "scaling_fit.sh: no ladder phase under $runs" >&2; exit 1; }
"$NOBUBBLE" report --scaling "${phases[@]/#/$runs/}" --paper-tokens 7200000000 \
    --out "$docs/fit" --title "The delay's gap against size and tokens"
cp "$docs/fit/laws.json" "$laws"
for phase in "${phases[@]}"; do
    "$NOBUBBLE" report "$runs/$phase" --out "$docs/$phase" --title "Scaling ladder: $phase"
done
