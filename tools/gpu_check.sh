#!/usr/bin/env bash
# Runs on a GPU machine over a copy of the built tree (build/ carried, no rebuild there):
# installs the wheels that travel in .whl/ (fla-core), runs the C++ tests, the whole pytest
# suite (GPU tests and the FLA convention checks included), FLA's own op tests with cula swapped in
# (where .fla-tests/ holds them) and compute-sanitizer memcheck and racecheck on small shapes of
# the CUDA kernels; with a second argument "bench", the GPU
# benchmarks as well ("bench-kda": the KDA chunked forward benchmark only; "bench-coverage": the
# model configurations against FLA only; "bench-train": the KDA and GDN training steps only; "bench-segments":
# few heads and long sequences, uncut and in parallel segments; "bench-fwd": the GDN,
# GLA, simple GLA and Lightning chunked forward benchmarks only). Logs and results go to the
# directory given (default: logs/).
set -uo pipefail
cd "$(dirname "$0")/.."
LOG=${1:-logs}
mkdir -p "$LOG"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/cula_site .whl/*.whl
  export PYTHONPATH=/tmp/cula_site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD/python:${PYTHONPATH:-}
export CULA_LIBRARY=$PWD/build/libcula.so
export FLA_FLASH_KDA=0 PYTHONUNBUFFERED=1
# FLA's Triton kernels compile and autotune on first use (minutes on a fresh machine). Their cache
# travels between machines as tar parts: unpacked from TRITON_CACHE_PARTS (default .triton_cache/,
# git-ignored) when it holds some (xz or gzip), packed with xz into $LOG/triton_cache/ at the end,
# parts under 16 MB (xz: about a third of gzip's size for these caches).
# CULA_PYTEST_TIMEOUT (seconds) bounds the pytest run, so that a cold run still packs what it
# compiled for the next one.
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/cula_triton_cache}
mkdir -p "$TRITON_CACHE_DIR"
PARTS=${TRITON_CACHE_PARTS:-.triton_cache}
if ls "$PARTS"/triton_cache.txz.part* >/dev/null 2>&1; then
  cat "$PARTS"/triton_cache.txz.part* | tar xJf - -C "$TRITON_CACHE_DIR"
elif ls "$PARTS"/triton_cache.tgz.part* >/dev/null 2>&1; then
  cat "$PARTS"/triton_cache.tgz.part* | tar xzf - -C "$TRITON_CACHE_DIR"
fi
status=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$LOG/summary.txt"
python3 -m cula info | tee -a "$LOG/summary.txt" || status=1
build/cula_tests --gtest_brief=1 2>&1 | tee "$LOG/ctest.txt" | tail -3 || status=1
# The GPU tests spend most of their time in the float64 host reference: with pytest-xdist present,
# test files run in CULA_PYTEST_WORKERS processes side by side (one file per process at a time).
PAR="-s"
if python3 -c "import xdist" 2>/dev/null; then PAR="-n ${CULA_PYTEST_WORKERS:-6} --dist loadfile"; fi
timeout "${CULA_PYTEST_TIMEOUT:-0}" python3 -m pytest -q -rs $PAR -p no:cacheprovider tests/python 2>&1 | tee "$LOG/pytest.txt" | tail -25
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
# FLA's own op tests with cula swapped in (the compatibility contract), where FLA's tests/ lie in
# .fla-tests/ (git-ignored; tools/fla_suite/run.py says how to make it): one process per test file,
# side by side (their float64 references are host-bound), merged into one summary. CULA_COMMIT, when
# set, names the commit of a copied tree without git metadata.
if [ -d .fla-tests/tests/ops ]; then
  mkdir -p "$LOG/results" "$LOG/fla_suite"
  skip=()
  [ -f bench/results/cpu/fla_suite.json ] && skip=(--skip-fla-only bench/results/cpu/fla_suite.json)
  given=()
  [ -n "${CULA_COMMIT:-}" ] && given=(--cula-commit "$CULA_COMMIT")
  files=$(python3 -c "import sys; sys.path.insert(0, 'tools/fla_suite'); import run; print(' '.join(run.FILES))")
  for f in $files; do
    OMP_NUM_THREADS=2 python3 tools/fla_suite/run.py --fla-tests .fla-tests --files "$f" ${skip[@]+"${skip[@]}"} \
      ${given[@]+"${given[@]}"} --out "$LOG/fla_suite/$f.json" > "$LOG/fla_suite/$f.log" 2>&1 &
  done
  wait
  for f in $files; do  # a file whose run wrote no summary (see its log) would be missing from the merge
    [ -f "$LOG/fla_suite/$f.json" ] || { echo "fla_suite: $f wrote no summary ($LOG/fla_suite/$f.log)"; status=1; }
  done
  python3 tools/fla_suite/run.py --merge "$LOG"/fla_suite/*.json --out "$LOG/results/fla_suite.json" \
    | tee "$LOG/fla_suite.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
# racecheck models __syncthreads, not mbarrier hand-offs nor a named barrier split into arrive and
# sync (it reports hazards on correct ones), so it runs with the fused kernels' 8-warp path and the
# chunk prep's block-barrier mode; synccheck checks the warp-specialized kernel's named barriers
# and mbarriers. The tests run under the sanitizers carry the pytest marker 'sanitize'.
for tool in memcheck racecheck synccheck; do
  env $([ "$tool" = racecheck ] && echo CULA_FUSED_8WARP=1 CULA_BLOCK_BARRIERS_ONLY=1) compute-sanitizer --tool "$tool" --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider \
    tests/python/test_gpu.py tests/python/test_gpu_decode.py tests/python/test_gpu_prefill.py tests/python/test_gpu_chunk_mma.py \
    tests/python/test_gpu_backward.py tests/python/test_segment_len.py \
    -m sanitize 2>&1 | tee -a "$LOG/sanitizer.txt" | tail -4
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done
if [ "${2:-}" = "bench" ]; then
  python3 -m cula bench decode --out "$LOG/results" 2>&1 | tee "$LOG/bench_decode.txt" | tail -25 || status=1
fi
if [ "${2:-}" = "bench" ] || [ "${2:-}" = "bench-kda" ]; then
  # FlashKDA joins when importable (built by hand from its public source; FLASHKDA_PATH names it)
  PYTHONPATH=$PYTHONPATH${FLASHKDA_PATH:+:$FLASHKDA_PATH} python3 -m cula bench kda --out "$LOG/results" 2>&1 \
    | tee "$LOG/bench_kda.txt" | tail -25 || status=1
fi
if [ "${2:-}" = "bench" ] || [ "${2:-}" = "bench-fwd" ]; then
  for fam in gdn gla simple_gla lightning; do
    python3 -m cula bench "$fam" --out "$LOG/results" 2>&1 | tee "$LOG/bench_$fam.txt" | tail -12 || status=1
  done
fi
if [ "${2:-}" = "bench" ] || [ "${2:-}" = "bench-coverage" ]; then
  python3 -m cula bench coverage --out "$LOG/results" 2>&1 | tee "$LOG/bench_coverage.txt" | tail -40 || status=1
fi
if [ "${2:-}" = "bench" ] || [ "${2:-}" = "bench-segments" ]; then
  python3 -m cula bench segments --out "$LOG/results" 2>&1 | tee "$LOG/bench_segments.txt" | tail -30 || status=1
fi
if [ "${2:-}" = "bench" ] || [ "${2:-}" = "bench-train" ]; then
  python3 -m cula bench train --out "$LOG/results" 2>&1 | tee "$LOG/bench_train.txt" | tail -40 || status=1
fi
if [ -n "$(ls -A "$TRITON_CACHE_DIR")" ]; then
  mkdir -p "$LOG/triton_cache"
  tar cf - -C "$TRITON_CACHE_DIR" . | xz -T0 -6 | split -b 15m - "$LOG/triton_cache/triton_cache.txz.part"
fi
echo "gpu_check status: $status" | tee -a "$LOG/summary.txt"
exit $status
