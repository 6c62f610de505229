#!/usr/bin/env bash
# One device call that produces every GPU figure the docs quote, bundled into $OUT/results.tgz.
#   STAGEBUF_BENCH_COMMIT=<sha> bash scripts/gpu_session.sh A   # GPU tests, torchrun, guard experiment, bench
#   STAGEBUF_BENCH_COMMIT=<sha> bash scripts/gpu_session.sh B   # GPU fuzzing, compute-sanitizer memcheck + racecheck
#   STAGEBUF_BENCH_COMMIT=<sha> bash scripts/gpu_session.sh C   # all GPU tests, bench, sanitizers on kernel tests
#   STAGEBUF_BENCH_COMMIT=<sha> bash scripts/gpu_session.sh D   # GPU tests, fuzzing (100 examples), torchrun, bench
#   STAGEBUF_BENCH_COMMIT=<sha> bash scripts/gpu_session.sh H   # memcheck and racecheck over every GPU test (2 GPUs,
#                                                               # about 5 minutes); runs E and F of docs/RELIABILITY.md
#                                                               # used modes E and F, as they are at commit 2c4ab4b
#   STAGEBUF_BENCH_COMMIT=<sha> [OLD_SRC=dir] bash scripts/gpu_session.sh G   # every GPU test, the hot-path probe
#       against an older src/ (OLD_SRC, e.g. `mkdir -p abtest/old && git archive <sha> src | tar -x -C abtest/old`
#       gives OLD_SRC=abtest/old/src), old and new interleaved twice, and the bench
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
  D)  # the resolving run, part 1 (a 2-GPU machine runs the non-zero-device tests and torchrun across GPUs)
    echo "commit: ${STAGEBUF_BENCH_COMMIT:-unknown}" > "$R/commit.txt"
    OUT=$R/rel BUDGET=${BUDGET:-420} GPU_TIMEOUT=${GPU_TIMEOUT:-150} FUZZ_EXAMPLES=${FUZZ_EXAMPLES:-100} \
      FUZZ_TIMEOUT=${FUZZ_TIMEOUT:-200} MP_TIMEOUT=${MP_TIMEOUT:-60} bash scripts/gpu_reliability.sh env gpu fuzz mp
    OUT=$R timeout 60 python3 scripts/guard_experiment.py 2000 > "$R/guard_experiment.txt" 2>&1
    OUT=$R/bench timeout ${BENCH_TIMEOUT:-150} bash scripts/gpu_bench.sh > "$R/bench_run.txt" 2>&1
    ;;
  H)  # memcheck (GPU 0) and racecheck (GPU 1) side by side over every GPU test
      # and then over the memlock and device-OOM fault tests; then, both GPUs visible, both tools over the
      # tests that need two GPUs and over torchrun with one process per GPU
    echo "commit: ${STAGEBUF_BENCH_COMMIT:-unknown}" > "$R/commit.txt"
    CS=${COMPUTE_SANITIZER:-/usr/local/cuda/bin/compute-sanitizer}
    lane() {  # lane TOOL GPU
      OUT=$R/$1 SAN_GPU=$2 SAN_MP=0 BUDGET=${SAN_BUDGET:-300} SAN_TIMEOUT=${SAN_TIMEOUT:-280} \
        bash scripts/gpu_reliability.sh "$1" > "$R/$1_run.txt" 2>&1
      (set -x; CUDA_VISIBLE_DEVICES=$2 STAGEBUF_UNDER_SANITIZER=1 timeout 120 "$CS" --tool "$1" \
        --target-processes all --print-limit 50 python3 -m pytest -m gpu -q -rs -p no:cacheprovider \
        -k "tiny_memlock or real_device_oom") > "$R/$1/faults.log" 2>&1
      echo "$1 over the memlock and device-OOM fault tests: exit $?" >> "$R/$1/summary.md"
      grep -E "SUMMARY|passed|failed|^FAILED" "$R/$1/faults.log" | sed 's/^/    /' >> "$R/$1/summary.md"
    }
    lane memcheck 0 &
    lane racecheck 1 &
    wait
    OUT=$R/two_gpus SAN_SELECT=non_zero_device BUDGET=${SAN2_BUDGET:-250} SAN_TIMEOUT=40 \
      SAN_MP_TIMEOUT=${SAN_MP_TIMEOUT:-150} bash scripts/gpu_reliability.sh memcheck racecheck \
      > "$R/two_gpus_run.txt" 2>&1
    cat "$R"/memcheck/summary.md "$R"/racecheck/summary.md "$R"/two_gpus/summary.md
    ;;
  G)  # the final check of a commit
    echo "commit: ${STAGEBUF_BENCH_COMMIT:-unknown}" > "$R/commit.txt"
    timeout ${GPU_TIMEOUT:-200} python3 -m pytest -m gpu -q -rs -p no:cacheprovider > "$R/gpu_tests_all.log" 2>&1
    echo "pytest -m gpu: exit $?"; tail -n 3 "$R/gpu_tests_all.log"
    if [ -n "${OLD_SRC:-}" ]; then
      for i in 1 2; do
        for v in old new; do
          p=src; [ $v = old ] && p=$OLD_SRC
          mkdir -p "$R/hotpath_$v$i"
          OUT=$R/hotpath_$v$i PYTHONPATH=$p timeout 90 python3 scripts/hotpath_probe.py > /dev/null 2>&1
          echo "hotpath $v $i: exit $?"
        done
      done
    fi
    OUT=$R/bench timeout ${BENCH_TIMEOUT:-150} bash scripts/gpu_bench.sh > "$R/bench_run.txt" 2>&1
    echo "bench: exit $?"
    ;;
esac
tail -n 60 "$R"/rel/summary.md 2>/dev/null
tail -n 25 "$R/guard_experiment.txt" 2>/dev/null
tail -n 40 "$R/bench/bench.txt" 2>/dev/null
tar czf "$OUT/results.tgz" -C "$R" .
