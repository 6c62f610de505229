#!/usr/bin/env bash
# The reliability stages of scripts/gpu.sh (fuzz, sanitize, multigpu): the GPU test suite, GPU fuzzing with many examples,
# compute-sanitizer memcheck and racecheck over the GPU tests, and a 2-process torchrun decode run.
#
#   OUT=/path/to/dir bash scripts/gpu_reliability.sh [STAGE ...]
#
# STAGE is any of: env gpu fuzz mp memcheck racecheck   (default: all of them, in that order).
# One command on the device machine may run for 10 minutes: the whole invocation keeps to BUDGET seconds
# (default 570), each stage getting at most its own limit and what is left; a stage with under 30 s left
# is skipped and says so. Suggested split, one device command each:
#   bash scripts/gpu_reliability.sh env gpu mp
#   bash scripts/gpu_reliability.sh fuzz
#   bash scripts/gpu_reliability.sh memcheck
#   bash scripts/gpu_reliability.sh racecheck
# On a 2-GPU machine (nvidia-h200-x2) the mp stage and the gpu stage put one process on each GPU and
# run the non-zero-device tests; on one GPU both processes share it.
#
# Knobs (environment): FUZZ_EXAMPLES (default 100) and FUZZ_STEPS (default 40) per machine and CUDA tier;
# SAN_FUZZ_EXAMPLES (default 3) under the sanitizers; MP_STEPS (default 500); PYTHON (default python3);
# COMPUTE_SANITIZER (default: found on PATH or under /usr/local/cuda*/bin); BUDGET; *_TIMEOUT per stage (s).
# Sanitizer stages: SAN_GPU (CUDA_VISIBLE_DEVICES for them: run memcheck and racecheck side by side on
# two GPUs), SAN_SELECT (a pytest -k expression to narrow the tests), SAN_MP=0 (skip the torchrun run).
# They set STAGEBUF_UNDER_SANITIZER=1: the run-ahead tests then take fewer steps and drop their
# "the guard had to wait" check, since the sanitizer slows the host too much for it to run ahead.
#
# Writes under $OUT (default ./out), at most 8 files:
#   env.txt          nvidia-smi, versions, device count, compute-sanitizer version, `stagebuf doctor --json`
#   gpu_tests.log    pytest -m gpu (every GPU-marked test but the fuzzing, which has its own stage)
#   fuzz.log         the CUDA-tier state machines with FUZZ_EXAMPLES examples each
#   fuzz_counts.json examples and steps actually run, per machine and tier
#   mp_decode.log    torchrun, 2 processes: one per GPU where 2 exist, then both on one GPU; JSON summaries
#   memcheck.log     compute-sanitizer --tool memcheck over pytest -m gpu (+ the torchrun run, all processes)
#   racecheck.log    compute-sanitizer --tool racecheck over pytest -m gpu (+ the torchrun run, all processes)
#   summary.md       per stage: command, exit status, seconds, and the lines docs/RELIABILITY.md quotes
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
# Keep NVLink multicast off (the device machines' rule), also for the processes torchrun starts.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}  # mp_decode gathers results over gloo, on this host
unset STAGEBUF_TIER

FUZZ_EXAMPLES=${FUZZ_EXAMPLES:-100}
FUZZ_STEPS=${FUZZ_STEPS:-40}
SAN_FUZZ_EXAMPLES=${SAN_FUZZ_EXAMPLES:-3}
MP_STEPS=${MP_STEPS:-500}
BUDGET=${BUDGET:-570}
START=$SECONDS
CS=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)}
SUMMARY="$OUT/summary.md"
# Deselected under the sanitizers: tests whose work runs in child processes (the sanitizer's
# application-only mode does not instrument them; the torchrun run below is instrumented on its own),
# and the deliberate out-of-memory tests (a refused cudaMalloc is reported as an API error).
SAN_DESELECT="not torchrun and not tiny_memlock and not real_device_oom"

stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(env gpu fuzz mp memcheck racecheck)

note() { echo "$*" | tee -a "$SUMMARY"; }

# run NAME TIMEOUT LOG CMD...: run CMD with a time limit, output to LOG (appended), record status.
run() {
  local name=$1 limit=$2 log=$3
  shift 3
  local left=$((BUDGET - (SECONDS - START) - 15))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 30 ]; then
    note ""
    note "### $name: SKIPPED, ${left}s of the ${BUDGET}s budget left"
    return 125
  fi
  local t0=$SECONDS
  local cmd
  cmd=$(printf '%q ' "$@")
  echo "+ $cmd" | tee -a "$log"
  timeout --signal=INT --kill-after=20 "$limit" "$@" >>"$log" 2>&1
  local rc=$?
  local dt=$((SECONDS - t0))
  note ""
  note "### $name: exit $rc in ${dt}s$([ $rc -eq 124 ] && echo " (TIMED OUT after ${limit}s)")"
  note '```'
  note "$cmd"
  note '```'
  return $rc
}

pytest_tail() {  # the last summary line of a pytest log, and its failures
  grep -E "^(FAILED|ERROR) " "$1" | head -20 | sed 's/^/    /' | tee -a "$SUMMARY"
  grep -E "[0-9]+ (passed|failed|skipped|deselected|errors?)\b.* in [0-9.]+s" "$1" | tail -1 | sed 's/^/    /' \
    | tee -a "$SUMMARY"
}

sanitizer_tail() {
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|LEAK SUMMARY" "$1" | sort | uniq -c | sed 's/^/    /' \
    | tee -a "$SUMMARY"
  local n
  n=$(grep -E "ERROR SUMMARY: [0-9]+ error" "$1" | sed -E 's/.*ERROR SUMMARY: ([0-9]+) error.*/\1/' \
      | awk '{s+=$1} END {print s+0}')
  note "    sanitizer errors reported in $(basename "$1") so far: $n"
}

echo "# gpu_reliability $(date -u +%Y-%m-%dT%H:%M:%SZ) stages: ${stages[*]}" >>"$SUMMARY"

for stage in "${stages[@]}"; do
  case $stage in
  env)
    {
      echo "# date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
      # STAGEBUF_BENCH_COMMIT first: the device machine's copy of .git can name an older HEAD
      echo "# commit: ${STAGEBUF_BENCH_COMMIT:-$(git rev-parse --verify -q HEAD 2>/dev/null || echo unknown)}"
      nvidia-smi || echo "nvidia-smi: not available"
      "$PY" - <<'EOF'
import platform
from importlib import metadata
import torch
print("python", platform.python_version())
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(),
      "devices", torch.cuda.device_count())
for i in range(torch.cuda.device_count()):
    print("device", i, torch.cuda.get_device_name(i), torch.cuda.get_device_capability(i))
for dist in ("triton", "cuda-bindings", "numpy", "hypothesis", "pytest"):
    try:
        print(dist, metadata.version(dist))
    except metadata.PackageNotFoundError:
        print(dist, "not installed")
EOF
      echo "compute-sanitizer: ${CS:-not found}"
      [ -n "$CS" ] && "$CS" --version
      echo "ulimit -l: $(ulimit -l); uid: $(id -u)"
      "$PY" -m stagebuf doctor --json
    } >"$OUT/env.txt" 2>&1
    note ""
    note "### env"
    grep -E "^(torch|triton|cuda-bindings|device [0-9])|NVIDIA H|Version|\"tier\"" "$OUT/env.txt" | head -12 \
      | sed 's/^/    /' | tee -a "$SUMMARY"
    ;;
  gpu)
    run "GPU test suite" "${GPU_TIMEOUT:-420}" "$OUT/gpu_tests.log" \
      "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider --ignore=tests/property/test_fuzz.py
    pytest_tail "$OUT/gpu_tests.log"
    ;;
  fuzz)
    rm -f "$OUT/fuzz_counts.json"
    STAGEBUF_FUZZ_EXAMPLES=$FUZZ_EXAMPLES STAGEBUF_FUZZ_STEPS=$FUZZ_STEPS \
      STAGEBUF_FUZZ_REPORT="$OUT/fuzz_counts.json" \
      run "GPU fuzzing (STAGEBUF_FUZZ_EXAMPLES=$FUZZ_EXAMPLES STAGEBUF_FUZZ_STEPS=$FUZZ_STEPS)" \
      "${FUZZ_TIMEOUT:-420}" "$OUT/fuzz.log" \
      "$PY" -m pytest tests/property/test_fuzz.py -m gpu -q -p no:cacheprovider --durations=0
    pytest_tail "$OUT/fuzz.log"
    [ -f "$OUT/fuzz_counts.json" ] && "$PY" - "$OUT/fuzz_counts.json" <<'EOF' | tee -a "$SUMMARY"
import json, sys
d = json.load(open(sys.argv[1]))
print("    | machine | tier | examples | steps |")
print("    | --- | --- | --- | --- |")
for m in sorted(k for k in d if not k.startswith("_")):
    for t, v in sorted(d[m].items()):
        print(f"    | {m} | {t} | {v['examples']} | {v['steps']} |")
EOF
    ;;
  mp)
    ngpu=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
    tmp=$(mktemp -d)
    run "torchrun, 2 processes, default placement ($ngpu GPU(s) visible)" "${MP_TIMEOUT:-240}" \
      "$OUT/mp_decode.log" "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 \
      scripts/mp_decode.py --steps "$MP_STEPS" --out "$tmp/default"
    grep -E "^mp_decode:" "$OUT/mp_decode.log" | tail -8 | sed 's/^/    /' | tee -a "$SUMMARY"
    if [ "$ngpu" -ge 2 ]; then
      run "torchrun, 2 processes sharing cuda:0" "${MP_TIMEOUT:-240}" "$OUT/mp_decode.log" \
        "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 \
        scripts/mp_decode.py --steps "$MP_STEPS" --shared-gpu --out "$tmp/shared"
      grep -E "^mp_decode:" "$OUT/mp_decode.log" | tail -8 | sed 's/^/    /' | tee -a "$SUMMARY"
    fi
    rm -rf "$tmp"
    ;;
  memcheck | racecheck)
    if [ -z "$CS" ]; then
      note ""
      note "### $stage: compute-sanitizer not found (set COMPUTE_SANITIZER)"
      continue
    fi
    log="$OUT/$stage.log"
    extra=()
    [ "$stage" = memcheck ] && extra=(--leak-check no)
    [ "$stage" = racecheck ] && extra=(--racecheck-report all)
    # The caching allocator stays on: without it each allocation is a cudaMalloc, which CUDA-graph
    # capture refuses (the graph tests then fail under memcheck, with no memory error found).
    envs=(env STAGEBUF_UNDER_SANITIZER=1)
    [ -n "${SAN_GPU:-}" ] && envs+=(CUDA_VISIBLE_DEVICES="$SAN_GPU")
    sel=$SAN_DESELECT
    [ -n "${SAN_SELECT:-}" ] && sel="($SAN_SELECT) and $SAN_DESELECT"
    STAGEBUF_FUZZ_EXAMPLES=$SAN_FUZZ_EXAMPLES STAGEBUF_FUZZ_STEPS=15 \
      run "compute-sanitizer $stage over pytest -m gpu${SAN_GPU:+ (CUDA_VISIBLE_DEVICES=$SAN_GPU)}" \
      "${SAN_TIMEOUT:-480}" "$log" \
      "${envs[@]}" "$CS" --tool "$stage" "${extra[@]}" --target-processes application-only \
      --print-limit 50 "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider -k "$sel"
    pytest_tail "$log"
    sanitizer_tail "$log"
    if [ "${SAN_MP:-1}" = 1 ]; then
      tmp=$(mktemp -d)
      run "compute-sanitizer $stage over torchrun (all processes)" "${SAN_MP_TIMEOUT:-200}" "$log" \
        "${envs[@]}" "$CS" --tool "$stage" "${extra[@]}" --target-processes all --print-limit 50 \
        "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 scripts/mp_decode.py \
        --steps 40 --busy 256 --out "$tmp"
      grep -E "^mp_decode:" "$log" | tail -8 | sed 's/^/    /' | tee -a "$SUMMARY"
      sanitizer_tail "$log"
      rm -rf "$tmp"
    fi
    ;;
  *)
    echo "gpu_reliability: unknown stage '$stage' (env gpu fuzz mp memcheck racecheck)" >&2
    exit 2
    ;;
  esac
done
echo "gpu_reliability: done; summary in $SUMMARY"
