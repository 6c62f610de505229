#!/usr/bin/env bash
# compute-sanitizer memcheck over every GPU test in $SAN_LANES (default 3) parallel lanes on one GPU (test files dealt
# round-robin by test count), then the 6 fault tests (tiny memlock, real device OOM) under memcheck
# and racecheck with all processes instrumented. The caching allocator stays on: without it every
# allocation is a cudaMalloc, which CUDA-graph capture refuses (cudaErrorStreamCaptureUnsupported).
# Racecheck over the GPU tests: SAN_MP=0 OUT=dir bash scripts/gpu_reliability.sh racecheck.
#
#   OUT=dir [SAN_LANES=3] bash scripts/sanitize_lanes.sh   (from the checkout; writes mem0.log..., *_faults.log)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"
CS=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}
export STAGEBUF_UNDER_SANITIZER=1 STAGEBUF_FUZZ_EXAMPLES=3 STAGEBUF_FUZZ_STEPS=15 PYTHONPATH=src:. PYTHONUNBUFFERED=1
unset STAGEBUF_TIER
SEL="not torchrun and not tiny_memlock and not real_device_oom"
files=$(python3 -m pytest -m gpu --collect-only -q -p no:cacheprovider -k "$SEL" 2>/dev/null | grep "::" \
  | cut -d: -f1 | sort | uniq -c | sort -rn | awk '{print $2}')
N=${SAN_LANES:-3}
lanes=()
for ((b = 0; b < N; b++)); do lanes+=(""); done
i=0
for f in $files; do lanes[$((i % N))]+=" $f"; i=$((i + 1)); done
MC=("$CS" --tool memcheck --leak-check no --print-limit 50)
for ((b = 0; b < N; b++)); do
  # shellcheck disable=SC2086
  (timeout "${SAN_LANE_TIMEOUT:-540}" "${MC[@]}" --target-processes application-only python3 -m pytest -m gpu -q -rs \
    -p no:cacheprovider -k "$SEL" ${lanes[$b]} >"$OUT/mem$b.log" 2>&1; echo "exit $?" >>"$OUT/mem$b.log") &
done
(
  timeout 300 "${MC[@]}" --target-processes all python3 -m pytest -m gpu -q -rs -p no:cacheprovider \
    -k "tiny_memlock or real_device_oom" >"$OUT/mem_faults.log" 2>&1
  echo "exit $?" >>"$OUT/mem_faults.log"
  timeout 200 "$CS" --tool racecheck --racecheck-report all --target-processes all python3 -m pytest -m gpu \
    -q -rs -p no:cacheprovider -k "tiny_memlock or real_device_oom" >"$OUT/race_faults.log" 2>&1
  echo "exit $?" >>"$OUT/race_faults.log"
) &
wait
for f in $(for ((b = 0; b < N; b++)); do echo "mem$b"; done) mem_faults race_faults; do
  echo "== $f"; grep -E "passed|failed|ERROR SUMMARY|RACECHECK SUMMARY|^exit|^FAILED" "$OUT/$f.log" | tail -6
done
