"""Calibration: INT8/INT4 quantization of artifacts with a measured quality report.

Schemes: ``w8a8`` static INT8 Q/DQ (calibrated activations, per-channel weights; the graphs
TensorRT reads), ``w8`` and ``w4`` weight-only MatMulNBits. Both graphs are quantized; decode
is calibrated on real KV caches (``feeds``). ``kv_cache="int8"`` also stores the KV cache as
int8 (``kv_int8``), with a scheme or alone.

    calibrate.py   calibrate_artifact: the stage, artifact + text -> quantized artifact + report
    options.py     CalibrationOptions: the scheme, its recipe and the search, checked
    search.py      the accuracy-aware search (candidates.py builds, judge.py scores and times,
                   sensitivity.py ranks MatMuls in one local pass)
    pipeline.py    quantizing both graphs with the chosen recipe; writing the new artifact
    report.py      quality.json: perplexity, top-1 agreement, KL, sizes (encoder.py: cosine)

Importing this package loads neither onnx nor onnxruntime; the work happens in ``calibrate_artifact``.
"""

from llmx.calibration.calibrate import calibrate_artifact
from llmx.calibration.options import KV_CACHE_DTYPES, SCHEMES, CalibrationOptions
from llmx.calibration.static import METHODS

__all__ = ["CalibrationOptions", "SCHEMES", "KV_CACHE_DTYPES", "METHODS", "calibrate_artifact"]
