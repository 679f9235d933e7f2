#!/usr/bin/env bash
# The GPU check of issue 11: on a machine with CUDA GPUs, in under ten minutes, run the parity
# tests that matter on NCCL and `nobubble bench --dp` on NCCL, sized to the GPUs there are, and
# write everything into one folder (printed at the start and at the end).
#
#   scripts/gpu_check.sh                  # results in gpu-check-YYYYmmdd-HHMMSS/
#   GPU_CHECK_OUT=/tmp/check scripts/gpu_check.sh
#
# Environment:
#   VENV              the virtual environment (default .venv), made by scripts/bootstrap.sh if
#                     missing. bootstrap reuses a torch >= 2.9 that $PYTHON already has (keep
#                     your CUDA build: PYTHON=/path/to/python-with-cuda-torch), else installs
#                     $NOBUBBLE_TORCH (default torch==2.13.0). A venv whose torch cannot see a
#                     GPU (a CPU wheel) is refused with what to do instead.
#   GPU_CHECK_OUT     the results folder (default gpu-check-<date>-<time> here)
#   GPU_CHECK_BUDGET_S  seconds for the whole check (default 540): a step that would start with
#                     less than a minute left is skipped and says so; each step's timeout is
#                     what is left
#   GPU_CHECK_GPUS    use at most this many GPUs (default: all visible)
#
# What runs, by the number of GPUs N (one process per GPU; NCCL refuses two ranks on one GPU):
#   N = 0  nothing: an error
#   N = 1  no NCCL run is possible; a single-process run of the simulator on cuda and the same
#          run on the CPU, final losses side by side; an MoE model in one process on cuda
#   N >= 2 + pipeline parity P = 2 on NCCL (1f1b; 2bw with Muon and EF, M = 4), data-parallel
#          parity with P = 1, dp = 2, MoE pipeline parity P = 2 (2bw, Muon, EF), and
#          `nobubble bench` P = 2 (ours vs torch) and P = 1,
#          dp = 2 (the all-reduce behind compute, M = 2P and M = P)
#   N >= 4 + data-parallel parity P = 2, dp = 2 (sync and 2bw, AdamW, and 2bw with EF), bench
#          P = 2, dp = 2 at M = 2P = 4 and M = P = 2, then, as time allows, parity P = 4
# Parity tests run with NOBUBBLE_TEST_DEVICE=cuda (tests/pipeline_helpers.py adds device=cuda
# to their settings) and CUBLAS_WORKSPACE_CONFIG=:4096:8 (deterministic cuBLAS): the pipeline
# tests compare bitwise with the single-process run, which on a GPU also assumes deterministic
# kernels; a mismatch there is worth rerunning one case twice on one GPU before blaming NCCL.
#
# On NCCL the pipeline runs take p2p_routes=auto's per-edge routes (docs/pipeline.md, Messages):
# a hang at the first step of a parity test points at them.
#
# Exit status: 0 when every step that ran passed, 1 otherwise (each step's log is in the folder).
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

log() { printf '[gpu_check %4ds] %s\n' $((SECONDS - START)) "$*" | tee -a "$OUT/gpu_check.log" >&2; }
die() {
    log "error: $*"
    exit 1
}
left() { echo $((BUDGET_S - (SECONDS - START))); }

log "results go to $OUT"
printf '# GPU check, %s\n\n| step | result | seconds |\n|---|---|---:|\n' "$(date -u +%FT%TZ)" >"$SUMMARY"

# step NAME COMMAND...: run COMMAND with what is left of the budget as its timeout, its output in
# $OUT/NAME.log; record pass / FAIL / skipped in the summary; never stop the script.
step() {
    local name=$1
    shift
    local budget
    budget=$(left)
    if ((budget < 60)); then
        log "$name: skipped, ${budget}s of the budget left"
        echo "| $name | skipped (out of time) | 0 |" >>"$SUMMARY"
        return 0
    fi
    log "$name: $* (timeout ${budget}s)"
    local began=$SECONDS rc=0
    timeout --kill-after=10 "$budget" "$@" >"$OUT/$name.log" 2>&1 || rc=$?
    local took=$((SECONDS - began)) result
    case $rc in
    0) result=pass ;;
    5) result="FAIL: the test selection matched nothing (case lists changed? update this script)" ;;
    124 | 137) result="FAIL: timed out after ${took}s" ;;
    *) result="FAIL: exit status $rc" ;;
    esac
    [ "$rc" -eq 0 ] || FAILED=1
    log "$name: $result (${took}s; log $OUT/$name.log)"
    [ "$rc" -eq 0 ] || tail -n 15 "$OUT/$name.log" >&2
    echo "| $name | $result | $took |" >>"$SUMMARY"
}

# -- the environment -----------------------------------------------------------------------------
log "bootstrapping $VENV (scripts/bootstrap.sh)"
if ! VENV="$VENV" scripts/bootstrap.sh >>"$OUT/gpu_check.log" 2>&1; then
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

# -- one GPU: no NCCL run is possible ------------------------------------------------------------
# the simulator in one process: 2bw, P = 2, M = 4 (add device=...)
SINGLE=(schedule=2bw stages=2 microbatches=4 steps=20 batch_size=16 seq_len=128 eval_every=0
    checkpoint_every=0)
step single-process-cuda "$PY" -m nobubble train --no-progress --overwrite \
    --out "$OUT/runs/single-cuda" device=cuda "${SINGLE[@]}"
# an MoE model (docs/moe.md): routing, bias balancing and the statistics on cuda
step moe-single-process-cuda "$PY" -m nobubble train --no-progress --overwrite \
    --out "$OUT/runs/moe-single-cuda" device=cuda preset=cpu-moe moe_bias_rate=0.001 \
    "${SINGLE[@]}"
if ((GPUS == 1)); then
    step single-process-cpu "$PY" -m nobubble train --no-progress --overwrite \
        --out "$OUT/runs/single-cpu" device=cpu "${SINGLE[@]}"
    for device in cuda cpu; do
        metrics="$OUT/runs/single-$device/metrics.jsonl"
        [ -f "$metrics" ] && echo "single-process $device: last train loss $(grep train_loss "$metrics" |
            tail -n 1)" >>"$SUMMARY"
    done
    log "one GPU: NCCL needs two ranks on two GPUs, so no pipeline, data-parallel or bench run on"
    log "NCCL was possible; checked: training on cuda in one process (the simulator)"
    echo -e "\nOne GPU: no NCCL run possible (one rank per GPU); only the single-process runs." \
        >>"$SUMMARY"
fi

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
