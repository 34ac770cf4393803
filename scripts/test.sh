#!/usr/bin/env bash
# A fresh virtual environment with llmx, every CPU extra and the test tools; then the tests.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -k parity`).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch is pinned to 2.13.0 (CPU wheel); constraints.txt pins what the suite last passed with.
.venv/bin/python -m pip install -q -c constraints.txt -e '.[all,test,bench]'
exec .venv/bin/python -m pytest -q "$@"
