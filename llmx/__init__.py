"""llmx: export, quantize, build and serve transformer LLMs through ONNX.

The artifact directory (``llmx.json`` plus graph and tokenizer files) is the only contract
between stages: export -> runtime -> optimize -> calibration -> serve. Each stage reads a
manifest and writes a new artifact; no stage imports a later one.
"""

__version__ = "0.1.0"

import os as _os

# ONNX Runtime 1.31's Linux wheels start Microsoft's 1DS telemetry at import, which writes a
# session file (.ses) into TMPDIR and a database under ~/.cache: an offline edge box and a
# command that promises to leave nothing behind want neither. Set before any llmx module
# imports onnxruntime; a caller who wants it sets ORT_DISABLE_TELEMETRY=0 first.
_os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")
