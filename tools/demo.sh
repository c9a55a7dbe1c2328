#!/usr/bin/env bash
# Sets up a fresh machine (builds and installs the package) and runs the main job, `cula demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --disable-pip-version-check .
python3 -m cula info
python3 -m cula demo "$@"
