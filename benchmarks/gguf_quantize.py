"""Quantize a GGUF with llama.cpp's own quantizer (as the ``llama-quantize`` tool does).

    python gguf_quantize.py IN.gguf OUT.gguf q8_0|q4_0

Runs in the peers venv through llama-cpp-python's binding of ``llama_model_quantize``, so the
quantized file comes from the same llama.cpp build that runs it, with its default choices
(e.g. which tensors keep a higher precision).
"""

import os
import sys

import llama_cpp

src, out, ftype = sys.argv[1], sys.argv[2], sys.argv[3]
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype.upper()}")
params.nthread = os.cpu_count() or 1
if llama_cpp.llama_model_quantize(src.encode(), out.encode(), params) != 0:
    sys.exit(f"llama_model_quantize failed for {src} -> {out} ({ftype})")
