#!/usr/bin/env bash
# One device call that produces every GPU figure the docs quote, bundled into $OUT/results.tgz.
#   STAGEBUF_BENCH_COMMIT=<sha> bash scripts/gpu_session.sh A   # GPU tests, torchrun, guard experiment, bench
#   STAGEBUF_BENCH_COMMIT=<sha> bash scripts/gpu_session.sh B   # GPU fuzzing, compute-sanitizer memcheck + racecheck
#   STAGEBUF_BENCH_COMMIT=<sha> bash scripts/gpu_session.sh C   # all GPU tests, bench, sanitizers on kernel tests
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=src
R=/tmp/stagebuf_results; mkdir -p "$R"
case "${1:-A}" in
  A)
    OUT=$R/rel GPU_TIMEOUT=${GPU_TIMEOUT:-200} MP_TIMEOUT=${MP_TIMEOUT:-80} bash scripts/gpu_reliability.sh env gpu mp
    OUT=$R timeout 60 python3 scripts/guard_experiment.py 2000 > "$R/guard_experiment.txt" 2>&1
    OUT=$R/bench timeout ${BENCH_TIMEOUT:-200} bash scripts/gpu_bench.sh > "$R/bench_run.txt" 2>&1
    ;;
  B)
    OUT=$R/rel FUZZ_EXAMPLES=${FUZZ_EXAMPLES:-60} FUZZ_TIMEOUT=${FUZZ_TIMEOUT:-130} SAN_TIMEOUT=${SAN_TIMEOUT:-150} \
      SAN_MP_TIMEOUT=${SAN_MP_TIMEOUT:-60} bash scripts/gpu_reliability.sh fuzz memcheck racecheck
    ;;
  C)  # the resolving run: every GPU test (fuzzing included), the bench, sanitizers over the kernels' tests
    timeout ${GPU_TIMEOUT:-200} python3 -m pytest -m gpu -q -p no:cacheprovider > "$R/gpu_tests_all.log" 2>&1
    tail -n 5 "$R/gpu_tests_all.log"
    OUT=$R/bench timeout ${BENCH_TIMEOUT:-150} bash scripts/gpu_bench.sh > "$R/bench_run.txt" 2>&1
    SAN="staged_write or stager or param_table or kernels"
    for tool in memcheck racecheck; do
      timeout ${SAN_TIMEOUT:-100} /usr/local/cuda/bin/compute-sanitizer --tool $tool --target-processes application-only \
        --print-limit 50 python3 -m pytest -m gpu -q -p no:cacheprovider --ignore=tests/test_fuzz.py -k "$SAN" \
        > "$R/$tool.log" 2>&1
      echo "$tool exit $?"; grep -E "ERROR SUMMARY|passed|failed" "$R/$tool.log" | tail -3
    done
    ;;
esac
tail -n 60 "$R"/rel/summary.md 2>/dev/null
tail -n 25 "$R/guard_experiment.txt" 2>/dev/null
tail -n 40 "$R/bench/bench.txt" 2>/dev/null
tar czf "$OUT/results.tgz" -C "$R" .
