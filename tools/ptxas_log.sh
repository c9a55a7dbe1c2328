#!/usr/bin/env bash
# Compiler launcher of the CUDA objects (CMAKE_CUDA_COMPILER_LAUNCHER): runs the compile command as
# given and keeps what it printed (ptxas's spill and local-memory warnings) beside the object as
# <object>.ptxas.txt, for tools/check_spills.py. The output still reaches the build log.
set -uo pipefail
obj=""
prev=""
for a in "$@"; do
  [[ "$prev" == "-o" ]] && obj="$a"
  prev="$a"
done
if [[ -z "$obj" ]]; then exec "$@"; fi
"$@" 2> >(tee "$obj.ptxas.txt" >&2)
rc=$?
wait
exit $rc
