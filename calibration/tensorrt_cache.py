"""TensorRT calibration tables, written from the ranges the Q/DQ graphs were quantized with.

TensorRT 10 and 11 read the w8a8 graphs' Q/DQ nodes directly (explicit quantization; 11 has
no other INT8 mode). For TensorRT 10.x's implicit INT8 (``setDynamicRange`` or an
``IInt8Calibrator`` cache) and ONNX Runtime's TensorRT provider
(``trt_int8_calibration_table_name``), each graph also gets, under ``tensorrt/<graph>/``:

    calibration.flatbuffers, calibration.cache, calibration.json   ONNX Runtime's table files
                                (``quant_utils.write_calibration_table``: tensor -> abs max)
    trt10.cache                  TensorRT's own cache text: a ``TRT-<version>-<algorithm>`` header,
                                then ``tensor: <scale as big-endian float32 hex>`` lines

Keys are the activation tensors that feed the graph's QuantizeLinear nodes; the scale of each
is exactly the Q/DQ scale (abs max / 127), so every engine sees the same ranges.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from llmx.calibration.static import INT8_MAX

# TensorRT encodes its version as major*10000 + minor*100 + patch since 10.0; a builder with
# another 10.x version may rewrite the header (the scales do not depend on the version).
TRT_VERSION = 100000
ALGORITHMS = {"entropy": "EntropyCalibration2", "minmax": "MinMaxCalibration", "percentile": "MinMaxCalibration"}


def scale_hex(scale: float) -> str:
    return struct.pack(">f", scale).hex()


def trt_cache_text(scales: dict[str, float], method: str, version: int = TRT_VERSION) -> str:
    lines = [f"TRT-{version}-{ALGORITHMS[method]}"]
    lines += [f"{name}: {scale_hex(scale)}" for name, scale in sorted(scales.items())]
    return "\n".join(lines) + "\n"


def read_trt_cache(text: str) -> tuple[str, dict[str, float]]:
    """(header, tensor -> scale) of a TensorRT cache; the inverse of ``trt_cache_text``."""
    header, *lines = text.strip().splitlines()
    scales = {}
    for line in lines:
        name, _, value = line.rpartition(": ")
        scales[name] = struct.unpack(">f", bytes.fromhex(value))[0]
    return header, scales


def write_tables(directory: Path, scales: dict[str, float], method: str) -> list[str]:
    """Write one graph's tables into ``directory``; returns the file names written."""
    from onnxruntime.quantization.calibrate import TensorData
    from onnxruntime.quantization.quant_utils import write_calibration_table

    directory.mkdir(parents=True, exist_ok=True)
    table = {}
    for name, scale in scales.items():
        amax = np.float32(scale * INT8_MAX)
        table[name] = TensorData(lowest=np.array(-amax, np.float32), highest=np.array(amax, np.float32))
    write_calibration_table(table, str(directory))
    (directory / "trt10.cache").write_text(trt_cache_text(scales, method))
    return ["calibration.flatbuffers", "calibration.cache", "calibration.json", "trt10.cache"]
