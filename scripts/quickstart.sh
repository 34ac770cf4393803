#!/usr/bin/env bash
# The first run: a fresh virtual environment with llmx, then its main job on the built-in demo
# model (a 4.9M-parameter Llama trained on CPython's stdlib, shipped in llmx/demo_model):
# export -> optimize -> calibrate to INT8 -> generate -> JSON that follows a schema. Offline (no model download), CPU only.
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
step() { printf '\n\033[1m[%s] %s\033[0m\n' "$1" "$2" >&2; }
took() { printf '    (%ss)\n' "$((SECONDS - $1))" >&2; }

t=$SECONDS; step 1/6 "virtual environment .venv with llmx (CPU runtime, export, calibration, server)"
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch is pinned to 2.13.0 (CPU wheel); constraints.txt pins what the tests last passed with.
.venv/bin/python -m pip install -q -c constraints.txt -e '.[cpu,export,calibrate,serve]'
export PATH="$PWD/.venv/bin:$PATH"
took $t

t=$SECONDS; step 2/6 "export the demo model to ONNX (prefill + decode graphs), checked against PyTorch"
llmx export llmx/demo_model -o artifacts/demo --verify --force
took $t

t=$SECONDS; step 3/6 "optimize for ONNX Runtime (fused attention with in-place KV cache, fused norms)"
llmx optimize artifacts/demo -o artifacts/demo-opt --force
took $t

t=$SECONDS; step 4/6 "calibrate to INT8 weights on stdlib source, and measure what it cost"
stdlib=$(python -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
llmx calibrate artifacts/demo-opt --data "$stdlib/json" --scheme w8 -o artifacts/demo-int8 --force
took $t

t=$SECONDS; step 5/6 "generate (streamed as it is produced)"
llmx generate artifacts/demo-int8 "def fibonacci(n):" --max-new-tokens 96 --temperature 0.7 --top-p 0.9 --seed 1
took $t

t=$SECONDS; step 6/6 "structured output: a chat answer constrained to a JSON schema (llguidance)"
cat > artifacts/user.schema.json <<'JSON'
{"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
 "age": {"type": "integer", "minimum": 0, "maximum": 120}, "role": {"enum": ["admin", "user"]}},
 "required": ["name", "age", "role"], "additionalProperties": false}
JSON
llmx generate artifacts/demo-int8 "A user as JSON" --chat --json-schema artifacts/user.schema.json --temperature 0
took $t

cat >&2 <<MSG

Done in $((SECONDS - started))s. Artifacts are in ./artifacts (llmx inspect artifacts/demo-int8).
Serve the INT8 model with an OpenAI-compatible API:
    .venv/bin/llmx serve artifacts/demo-int8 --port 8000
    curl -s localhost:8000/v1/completions -H 'content-type: application/json' \\
         -d '{"prompt": "import os\\n", "max_tokens": 48}'
    curl -s localhost:8000/v1/chat/completions -H 'content-type: application/json' \\
         -d '{"messages": [{"role": "user", "content": "A user as JSON"}], "max_tokens": 80,
              "response_format": {"type": "json_schema", "json_schema": {"name": "user",
                "schema": '"\$(cat artifacts/user.schema.json)"'}}}'
MSG
