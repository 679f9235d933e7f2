#!/usr/bin/env bash
# Issue 29: Muon against AdamW in tokens/s, one process, 2bw + EF, with Newton-Schulz in float32
# and in bfloat16, natively and with oneDNN restricted to AVX2 (a CPU without bfloat16
# instructions); the tiny preset and the corrections study's model; variants interleaved.
# Prints one line per run: model, oneDNN ISA, variant, repeat, tokens/s (docs/benchmarks.md).
#
#   experiments/muon_speed.sh            # 2 repeats, about 10 minutes on 2 cores
#   REPEATS=3 experiments/muon_speed.sh
set -euo pipefail
cd "$(dirname "$0")/.."
NOBUBBLE=${NOBUBBLE:-.venv/bin/nobubble}
PYTHON=${PYTHON:-.venv/bin/python}
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
STUDY="d_model=128 n_layers=6 n_heads=4 n_kv_heads=2 d_ff=352 seq_len=128 batch_size=16"

for repeat in $(seq "${REPEATS:-2}"); do
  for model in tiny study; do
    extra=""; [ "$model" = study ] && extra=$STUDY
    for isa in native AVX2; do
      for variant in adamw float32 bfloat16; do
        settings="optim=muon muon_ns_dtype=$variant"; [ "$variant" = adamw ] && settings="optim=adamw"
        run=$OUT/$model-$isa-$variant-$repeat
        isa_env=(); [ "$isa" = AVX2 ] && isa_env=(ONEDNN_MAX_CPU_ISA=AVX2)
        # shellcheck disable=SC2086  # the settings are words
        env "${isa_env[@]}" OMP_NUM_THREADS=1 "$NOBUBBLE" train --preset tiny $extra $settings \
            schedule=2bw correction=ef steps="${STEPS:-12}" eval_every=0 threads=1 --out "$run" > "$run.log" 2>&1 ||
            { cat "$run.log"; exit 1; }
        rate=$("$PYTHON" -c 'import json,sys; print(round(json.load(open(sys.argv[1]))["tokens_per_s"]))' "$run/summary.json")
        echo "$model $isa $variant $repeat $rate"
      done
    done
  done
done
