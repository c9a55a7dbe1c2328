#!/usr/bin/env bash
# The C++ suite under AddressSanitizer and UndefinedBehaviorSanitizer (host code: the C ABI,
# validation, the reference and the CPU backend), with many more random calls through the C ABI
# than the plain suite makes. Builds in a folder of its own (default /tmp/cula_asan; CUDA code for
# one architecture only, since no kernel runs here). Usage: tools/host_sanitizers.sh [BUILD_DIR] [CALLS]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-/tmp/cula_asan}
CALLS=${2:-5000}
flags="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined"
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
cmake -S . -B "$BUILD" "${generator[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCULA_CUDA_ARCHITECTURES=80 \
  -DCULA_BUILD_FAST_CALL=OFF -DCMAKE_CXX_FLAGS="$flags" -DCMAKE_SHARED_LINKER_FLAGS="$flags" \
  -DCMAKE_EXE_LINKER_FLAGS="$flags" >/dev/null
cmake --build "$BUILD" -j "$(nproc)" --target cula_tests
# protect_shadow_gap=0: the static CUDA runtime maps memory where ASan keeps its shadow gap.
export ASAN_OPTIONS=protect_shadow_gap=0:detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1
CULA_TEST_RANDOM_CALLS=$CALLS "$BUILD/cula_tests" --gtest_brief=1
