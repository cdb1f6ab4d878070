#!/usr/bin/env bash
# The whole GPU check of issue 44 in one command, from the source tree: the GPU lane, then the GPU benchmark.
#
#   bash benchmarks/gpu_check.sh                          # python3 from PATH: at most 7.5 min (the limits below)
#   PYTHON=.venv/bin/python bash benchmarks/gpu_check.sh  # another interpreter (CUDA torch, lightning, pytest)
#   make gpu                                              # the same (make gpu GPU_PYTHON=... for the interpreter)
#
# Nothing is installed: PYTHONPATH=src:tests:benchmarks. Stages, each under a wall-clock limit so that a hang cannot
# eat the machine's time (timeout kills the stage's whole process group, its fits included):
#   1. the GPU lane, `pytest -m gpu tests/test_gpu.py` (LANE_TIMEOUT, 180 s; about 2 min on one GPU);
#   2. benchmarks/gpu_step.py (BENCH_TIMEOUT, 270 s; it starts no repetition past BENCH_BUDGET, 195 s, once 7 are
#      done, and writes its results after every repetition), whatever the lane's outcome.
# Writes the logs under LOGS (runs/gpu): gpu_check.txt (versions, nvidia-smi, each stage's status and time),
# gpu_lane.log, gpu_lane.xml, gpu_step.log, and the benchmark's gpu_step.{json,md} (hardware, versions, date,
# commit), which replace benchmarks/results/gpu_step.{json,md} whenever this run wrote them (a partial run says so
# in both). With $OUT set, copies those six files into $OUT. Where the tree has no .git, name the commit:
# TOKEN_MEAN_COMMIT=abc1234. BENCH_ARGS: more arguments for gpu_step.py (BENCH_ARGS=--quick: a dry run of this
# script without CUDA, which records nothing).
# Exit status: 0 both passed, 1 the lane failed, 2 the benchmark failed, 3 both.
set -u -o pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
LANE_TIMEOUT=${LANE_TIMEOUT:-180}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-270}
BENCH_BUDGET=${BENCH_BUDGET:-$((BENCH_TIMEOUT - 75))}  # the last repetition (~30 s) and the report fit in the rest
LOGS=${LOGS:-runs/gpu}
RESULTS=benchmarks/results
export PYTHONPATH="src:tests:benchmarks${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
if [ -z "${TOKEN_MEAN_COMMIT:-}" ] && commit=$(git rev-parse --short HEAD 2>/dev/null); then
    export TOKEN_MEAN_COMMIT=$commit
fi
mkdir -p "$LOGS" "$RESULTS"
rm -f "$LOGS"/gpu_check.txt "$LOGS"/gpu_lane.* "$LOGS"/gpu_step.*  # what is there after the run is this run's
summary=$LOGS/gpu_check.txt

{
    echo "gpu_check.sh: $(date -u +%Y-%m-%dT%H:%M:%SZ), commit ${TOKEN_MEAN_COMMIT:-unknown}, $(uname -srm)"
    echo "limits: lane ${LANE_TIMEOUT} s, benchmark ${BENCH_TIMEOUT} s (budget ${BENCH_BUDGET} s)"
    timeout 60 "$PYTHON" -c 'import sys, torch, lightning, token_mean
print("python", sys.version.split()[0], sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count())
print("nccl", torch.cuda.nccl.version() if torch.cuda.is_available() else None)
print("lightning", lightning.__version__, "token_mean", token_mean.__file__)' 2>&1
    timeout 30 nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1
} >"$summary"
cat "$summary"

stage() {  # stage NAME LIMIT LOG COMMAND...: run it under its limit, tee its output, note its status and time
    local name=$1 limit=$2 log=$3 began=$SECONDS status
    shift 3
    echo "== $name (limit ${limit} s): $*"
    timeout -k 15 "$limit" "$@" 2>&1 | tee "$log"
    status=${PIPESTATUS[0]}
    local note="exit $status"
    if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
        note="$note: stopped at its ${limit} s limit"
    fi
    echo "$name: $note, $((SECONDS - began)) s" | tee -a "$summary"
    return "$status"
}

stage "GPU lane" "$LANE_TIMEOUT" "$LOGS/gpu_lane.log" \
    "$PYTHON" -m pytest -m gpu tests/test_gpu.py -v -rA -p no:cacheprovider --junitxml="$LOGS/gpu_lane.xml"
lane=$?
# shellcheck disable=SC2086  # BENCH_ARGS: words
stage "GPU benchmark" "$BENCH_TIMEOUT" "$LOGS/gpu_step.log" \
    "$PYTHON" benchmarks/gpu_step.py --budget "$BENCH_BUDGET" \
    --json "$LOGS/gpu_step.json" --markdown "$LOGS/gpu_step.md" ${BENCH_ARGS:-}
bench=$?
if [[ " ${BENCH_ARGS:-} " == *" --quick "* ]]; then
    echo "results: a --quick run, benchmarks/results/gpu_step.* left as they were" | tee -a "$summary"
elif [ -f "$LOGS/gpu_step.json" ] && [ -f "$LOGS/gpu_step.md" ]; then
    cp "$LOGS/gpu_step.json" "$LOGS/gpu_step.md" "$RESULTS/"
    echo "results: $RESULTS/gpu_step.json, $RESULTS/gpu_step.md" | tee -a "$summary"
else
    echo "results: none written (benchmarks/results/gpu_step.* left as they were)" | tee -a "$summary"
fi
echo "total: $SECONDS s" | tee -a "$summary"

if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    for file in "$LOGS/gpu_step.json" "$LOGS/gpu_step.md" "$summary" "$LOGS/gpu_lane.log" \
        "$LOGS/gpu_lane.xml" "$LOGS/gpu_step.log"; do
        if [ -f "$file" ]; then cp "$file" "$OUT/"; fi
    done
    echo "copied into $OUT: $(ls "$OUT" | tr '\n' ' ')"
fi
exit $(( (lane != 0) + 2 * (bench != 0) ))
