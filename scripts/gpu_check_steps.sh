# The GPU check's steps and how it stops, sourced by scripts/gpu_check.sh (and by
# tests/test_children.py, which runs a step on the CPU and stops it).
#
# Needs START (bash's $SECONDS at the start), BUDGET_S, OUT, SUMMARY and FAILED set; PY (the
# venv's python) by the first step.
#
# A stop (SIGTERM from a scheduler, Ctrl-C) goes to the step in flight through nobubble.children,
# the one rule of every nobubble command that starts processes (docs/reliability.md, "A stopped
# command stops what it started"): the step's whole process tree gets the signal and up to its
# grace period to exit, then whatever is left is killed; the script says so in one line and exits
# 128 + the signal's number. A command between steps (bootstrap, the plan, the comparisons) runs in
# the foreground and in the script's process group: it gets the terminal's Ctrl-C itself, and a
# SIGTERM to the script takes effect once it is done (bash runs a trap only between commands).

log() { printf '[gpu_check %4ds] %s\n' $((SECONDS - START)) "$*" | tee -a "$OUT/gpu_check.log" >&2; }
die() {
    log "error: $*"
    exit 1
}
left() { echo $((BUDGET_S - (SECONDS - START))); }

STEP_PID= # the step in flight, if any
STEP_NAME=

# stop SIGNAL STATUS: pass SIGNAL to the step in flight, wait for it (bounded: nobubble.children
# kills what is left after its grace period), say so and exit STATUS.
stop() {
    if [ -n "$STEP_PID" ]; then
        kill -s "$1" "$STEP_PID" 2>/dev/null || true
        wait "$STEP_PID" || true
    fi
    log "stopped by SIG$1${STEP_NAME:+ in step $STEP_NAME, none of whose processes is left}; results so far in $OUT"
    exit "$2"
}
trap 'stop TERM 143' TERM
trap 'stop INT 130' INT

# step NAME COMMAND...: run COMMAND with what is left of the budget as its timeout, its output in
# $OUT/NAME.log; record pass / FAIL / skipped in the summary; never stop the script. COMMAND runs
# in the background so that a stop reaches it at once: bash interrupts a `wait` for a trap.
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
    "$PY" -m nobubble.children --name "step $name" --timeout "$budget" -- "$@" \
        >"$OUT/$name.log" 2>&1 &
    STEP_PID=$! STEP_NAME=$name
    wait "$STEP_PID" || rc=$?
    STEP_PID= STEP_NAME=
    local took=$((SECONDS - began)) result
    case $rc in
    0) result=pass ;;
    5) result="FAIL: the test selection matched nothing (case lists changed? update this script)" ;;
    124) result="FAIL: timed out after ${took}s" ;;
    *) result="FAIL: exit status $rc" ;;
    esac
    [ "$rc" -eq 0 ] || FAILED=1
    log "$name: $result (${took}s; log $OUT/$name.log)"
    [ "$rc" -eq 0 ] || tail -n 15 "$OUT/$name.log" >&2
    echo "| $name | $result | $took |" >>"$SUMMARY"
}
