#!/usr/bin/env bash
# Builds everything (C++, CUDA for every target architecture, the Python package) and runs all
# tests that this machine can run: GoogleTest through ctest, then pytest on the installed package.
# GPU tests skip themselves without a GPU (tools/gpu_check.sh runs them on a GPU machine).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
python3 -m pip install -q --disable-pip-version-check -r requirements-test.txt
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
cmake -S . -B build "${generator[@]}" -DCMAKE_BUILD_TYPE=Release
t0=$(date +%s)
cmake --build build -j "$(nproc)"
echo "build time (C++ and CUDA): $(( $(date +%s) - t0 )) s"
ctest --test-dir build --output-on-failure
python3 -m pip install -q --disable-pip-version-check .
# Run pytest from outside the source tree so it imports the installed package.
(cd tests/python && python3 -m pytest -q -rs -p no:cacheprovider .)
echo "total time: $(( $(date +%s) - start )) s"
