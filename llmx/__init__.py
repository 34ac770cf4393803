"""llmx: export, quantize, build and serve transformer LLMs through ONNX.

The artifact directory (``llmx.json`` plus graph and tokenizer files) is the only contract
between stages: export -> runtime -> optimize -> calibration -> serve. Each stage reads a
manifest and writes a new artifact; no stage imports a later one.
"""

__version__ = "0.1.0"
