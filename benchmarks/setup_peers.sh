#!/usr/bin/env bash
# The benchmark peers' own venv: onnxruntime-genai and llama-cpp-python (compiled for this CPU).
set -euo pipefail
cd "$(dirname "$0")"
python3 -m venv .peers-venv
.peers-venv/bin/python -m pip install -q --upgrade pip
CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}" .peers-venv/bin/python -m pip install -q -r peers-requirements.txt
.peers-venv/bin/python -c "import onnxruntime_genai, llama_cpp; print('peers ready:', onnxruntime_genai.__version__, llama_cpp.__version__)"
