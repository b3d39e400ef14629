#!/usr/bin/env bash
# The README's test command: install CPU torch and the test extras, then run the CPU suite.
# (GPU tests carry the `cuda` marker and skip here; scripts/gpu_suite.sh runs them on a GPU.)
# The 30-minute per-test limit only catches a hang: the whole suite takes a few minutes, and a
# loaded machine (another process on a core) must not be able to trip it.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e ".[test]"
python3 -m pytest -q --timeout 1800 --durations=15 tests/
