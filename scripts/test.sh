#!/usr/bin/env bash
# A fresh virtual environment with llmx, every CPU extra and the test tools; then the tests.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -k parity`; `-n 0` runs it in one process).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch is pinned to 2.13.0 (CPU wheel); constraints.txt pins what the suite last passed with.
.venv/bin/python -m pip install -q -c constraints.txt -e '.[all,test,bench]'
# Two workers, whole files each (module fixtures are built once); they share the session store
# of tiny checkpoints and exports (tests/conftest.py), 6-7 instead of 10-11 minutes on 2 cores.
exec .venv/bin/python -m pytest -q -n 2 --dist loadfile "$@"
