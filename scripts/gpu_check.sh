#!/usr/bin/env bash
# The GPU check: on a machine with one CUDA GPU or more, in under ten minutes, train every pipeline
# schedule on SmolLM2-360M's shape (a few steps, short sequences, bfloat16) and print one table:
# each run's parity with a one-process run, tokens/s, MFU and peak memory (also as JSON); then, as
# time allows, the parity tests and `nobubble bench` on NCCL. Everything goes into one folder
# (printed at the start and at the end).
#
#   scripts/gpu_check.sh                  # results in gpu-check-YYYYmmdd-HHMMSS/
#   GPU_CHECK_OUT=/tmp/check scripts/gpu_check.sh
#
# Environment:
#   VENV              the virtual environment (default .venv), made by scripts/bootstrap.sh if
#                     missing, with every extra (LOCK=all: the tests run). bootstrap reuses a
#                     torch >= 2.9 that $PYTHON already has (keep your CUDA build:
#                     PYTHON=/path/to/python-with-cuda-torch), else installs $NOBUBBLE_TORCH
#                     (default locks/torch.txt's torch==2.13.0). A venv whose torch cannot see a
#                     GPU (a CPU wheel) is refused with what to do instead.
#   GPU_CHECK_OUT     the results folder (default gpu-check-<date>-<time> here)
#   GPU_CHECK_BUDGET_S  seconds for the whole check (default 540): a step that would start with
#                     less than a minute left is skipped and says so; each step's timeout is
#                     what is left, and each run of the table has its own below that (a run
#                     that passes it has every rank's Python stacks written into its log)
#   GPU_CHECK_GPUS    use at most this many GPUs (default: all visible)
#
# The table's runs (nobubble gpu-check plan --gpus N prints them; docs/benchmarks.md,
# "The GPU check"), by the number of GPUs N:
#   N = 0  nothing: an error
#   first, on any N: a smoke test (a tiny model, one 1F1B step, a stage on every GPU over NCCL;
#          one GPU: two processes under the emulator), then the rows; among them one throughput
#          row (smollm2-135m, seq 1024, 40 steps, MFU) and an audit of one step's actions under
#          torch.cuda.set_sync_debug_mode("warn"); rows needing more GPUs are listed as skipped
#   N = 1  every schedule (gpipe, 1f1b, 2bw, pipedream, interleaved-1f1b, zb-h1, zb-h2) on two
#          processes that share the GPU over gloo with CUDA tensors, under the NCCL emulator
#          (dist_backend=gloo emulate_nccl=true): every CUDA path of the pipeline but NCCL itself;
#          2bw again over plain gloo, and with compile and activation checkpointing
#   N >= 2 every schedule on NCCL, a GPU per process; 2bw once more sharing one GPU under the
#          emulator, and compiled
#   N >= 4 + 1f1b on four stages, 2bw on two stages x two replicas, 1f1b on two stages x two
#          replicas with zero=1 and with zero=2
#   N >= 8 + 2bw on four stages x two replicas, 1f1b on eight stages
# and the one-process references they are compared with (the 2bw one twice: whether the GPU
# repeats a run bit for bit). Each run's checkpoints are deleted once it is compared.
# Then, as time allows: an MoE model in one process on cuda; with N >= 2 the NCCL parity tests
# (tests/, with NOBUBBLE_TEST_DEVICE=cuda: device=cuda in their settings) and the benchmark.
# CUBLAS_WORKSPACE_CONFIG=:4096:8 makes cuBLAS deterministic; a row that is not bitwise is
# judged against the GPU's own run-to-run noise (the repeated reference).
#
# Exit status: 0 when every step that ran passed and every row of the table did, 1 otherwise
# (each step's log is in the folder); 128 + the signal's number when stopped by SIGTERM or Ctrl-C,
# which reach the step in flight and its every process (scripts/gpu_check_steps.sh).
# Status: written without a GPU machine; never executed yet (docs/benchmarks.md).
set -euo pipefail
cd "$(dirname "$0")/.."

START=$SECONDS
BUDGET_S=${GPU_CHECK_BUDGET_S:-540}
VENV=${VENV:-.venv}
OUT=${GPU_CHECK_OUT:-gpu-check-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
SUMMARY="$OUT/summary.md"
FAILED=0

# shellcheck source=scripts/gpu_check_steps.sh
. scripts/gpu_check_steps.sh # log, die, left, step; the stop

log "results go to $OUT"
printf '# GPU check, %s\n\n| step | result | seconds |\n|---|---|---:|\n' "$(date -u +%FT%TZ)" >"$SUMMARY"

# -- the environment -----------------------------------------------------------------------------
log "bootstrapping $VENV (scripts/bootstrap.sh)"
if ! VENV="$VENV" LOCK=all scripts/bootstrap.sh >>"$OUT/gpu_check.log" 2>&1; then
    tail -n 20 "$OUT/gpu_check.log" >&2
    die "scripts/bootstrap.sh failed (above; the whole log is $OUT/gpu_check.log)"
fi
PY="$VENV/bin/python"
[ -x "$PY" ] || die "$PY is missing after scripts/bootstrap.sh"

"$PY" - >"$OUT/environment.txt" 2>&1 <<'PY' || die "cannot import torch in $VENV: $(tail -n 3 "$OUT/environment.txt")"
import platform, torch
print("python", platform.python_version())
print("torch", torch.__version__, "cuda", torch.version.cuda)
print("gpus", torch.cuda.device_count())
if torch.cuda.is_available():
    for i in range(torch.cuda.device_count()):
        print(f"gpu{i}", torch.cuda.get_device_name(i))
    import torch.distributed as dist
    print("nccl", dist.is_nccl_available() and ".".join(map(str, torch.cuda.nccl.version())))
PY
if command -v nvidia-smi >/dev/null; then
    nvidia-smi >>"$OUT/environment.txt" 2>&1 || true
fi
sed -n '1,12p' "$OUT/environment.txt" >&2

VISIBLE=$(awk '$1 == "gpus" {print $2}' "$OUT/environment.txt")
TORCH=$(awk '$1 == "torch" {print $2, "(CUDA " $4 ")"}' "$OUT/environment.txt")
if [ "${VISIBLE:-0}" -eq 0 ]; then
    die "torch $TORCH in $VENV sees no CUDA GPU. If this machine has GPUs, the venv holds a CPU \
build of torch: make a venv from a python that has a CUDA torch (PYTHON=/path/to/python \
VENV=.venv-gpu scripts/gpu_check.sh), or install one into it (e.g. $VENV/bin/pip install torch \
--index-url https://download.pytorch.org/whl/cu128). Nothing else to check here: the CPU tests \
are \`make test\`."
fi
GPUS=$VISIBLE
if [ -n "${GPU_CHECK_GPUS:-}" ] && ((GPU_CHECK_GPUS < GPUS)); then
    GPUS=$GPU_CHECK_GPUS
fi
log "torch $TORCH sees $VISIBLE GPU(s); using $GPUS"
echo "used $GPUS of $VISIBLE GPU(s)" >>"$OUT/environment.txt"

export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
PYTEST=("$PY" -m pytest -q -p no:cacheprovider)
BENCH=("$PY" -m nobubble bench --device cuda --busy-retries 0 --repeats 1 --steps 30
    --warmup-steps 5 --preset small --seq-len 256 --batch-size 32)

# -- the table: the smoke test, then every schedule on SmolLM2-360M's shape (nobubble/gpu_check/)
"$PY" -m nobubble gpu-check plan --gpus "$GPUS" --out "$OUT" >"$OUT/plan.txt" 2>>"$OUT/gpu_check.log" ||
    die "nobubble gpu-check plan failed (see $OUT/gpu_check.log)"
mapfile -t PLANNED <"$OUT/plan.txt"
for line in "${PLANNED[@]}"; do
    # name, processes (0: one process), GPUs, the run it is compared with (- for none), settings;
    # `row` starts it on its first GPUs, within its own timeout (past it: every rank's stacks
    # into the step's log, then the run is stopped)
    read -r name _ _ reference _ <<<"$line"
    step "$name" "$PY" -m nobubble gpu-check row "$OUT" "$name"
    if [ "$reference" != - ]; then
        "$PY" -m nobubble gpu-check compare "$OUT" "$name" >>"$OUT/$name.log" 2>&1 ||
            log "$name: the comparison failed (see $OUT/$name.log)"
        rm -rf "$OUT/runs/$name/checkpoints" # seconds to write, gigabytes to keep
    fi
done
rm -rf "$OUT"/runs/one-process-*/checkpoints
"$PY" -m nobubble gpu-check table "$OUT" >"$OUT/table.md" 2>>"$OUT/gpu_check.log" || FAILED=1
{
    echo -e "\n## Every schedule, SmolLM2-360M's shape (table.json)\n"
    cat "$OUT/table.md"
} >>"$SUMMARY"
cat "$OUT/table.md" >&2

# -- as time allows --------------------------------------------------------------------------------
# an MoE model (docs/moe.md): routing, bias balancing and the statistics on cuda, in one
# process, with Muon (its Newton-Schulz in bfloat16 on a GPU)
step moe-single-process-cuda "$PY" -m nobubble train --no-progress --overwrite \
    --out "$OUT/runs/moe-single-cuda" device=cuda preset=cpu-moe moe_bias_rate=0.001 \
    optim=muon schedule=2bw stages=2 microbatches=4 steps=20 batch_size=16 seq_len=128 \
    eval_every=0

# -- two GPUs and more ---------------------------------------------------------------------------
if ((GPUS >= 2)); then
    export NOBUBBLE_TEST_DEVICE=cuda
    step parity-p2 "${PYTEST[@]}" tests/test_pipeline_parity.py \
        -k "test_pipeline_matches_the_simulation and (2-1f1b-2 or 2-2bw-4)"
    step data-parallel-p1-dp2 "${PYTEST[@]}" tests/test_data_parallel.py -k "1-sync-2"
    step moe-parity-p2 "${PYTEST[@]}" tests/test_moe_pipeline.py \
        -k "test_moe_pipeline_matches_the_simulation and 2-2bw-2"
fi
if ((GPUS >= 4)); then
    step data-parallel-p2-dp2 "${PYTEST[@]}" tests/test_data_parallel.py \
        -k "2-sync-2-extra0 or 2-2bw-2-extra2 or 2-2bw-2-extra3"
    for micro in 4 2; do # M = 2P, then M = P
        step "bench-p2-dp2-m$micro" "${BENCH[@]}" --stages 2 --dp 2 --microbatches "$micro" \
            --schedules 1f1b,2bw,torch-1f1b --json "$OUT/bench-p2-dp2-m$micro.json" \
            --runs-dir "$OUT/runs/bench-p2-dp2-m$micro"
    done
elif ((GPUS >= 2)); then
    step bench-p2 "${BENCH[@]}" --stages 2 --microbatches 4 \
        --schedules 1f1b,2bw,torch-1f1b --json "$OUT/bench-p2.json" --runs-dir "$OUT/runs/bench-p2"
    for micro in 2 1; do # M = 2P, then M = P
        step "bench-p1-dp2-m$micro" "${BENCH[@]}" --stages 1 --dp 2 --microbatches "$micro" \
            --schedules 1f1b,2bw,torch-1f1b --json "$OUT/bench-p1-dp2-m$micro.json" \
            --runs-dir "$OUT/runs/bench-p1-dp2-m$micro"
    done
fi
if ((GPUS >= 4)); then
    step parity-p4 "${PYTEST[@]}" tests/test_pipeline_parity.py \
        -k "test_pipeline_matches_the_simulation and 4-2bw-4"
fi

# -- the figures ---------------------------------------------------------------------------------
for log_file in "$OUT"/bench-*.log; do
    [ -f "$log_file" ] || continue
    {
        echo -e "\n## $(basename "$log_file" .log)\n"
        sed -n '/^P=/,$p' "$log_file"
    } >>"$SUMMARY"
done
{
    echo -e "\n## Environment\n"
    grep -E '^(python|torch|nccl|gpu|used)' "$OUT/environment.txt" | sed 's/^/    /'
} >>"$SUMMARY"

log "done in $((SECONDS - START))s; summary: $SUMMARY"
cat "$SUMMARY"
echo
echo "results: $OUT"
exit "$FAILED"
