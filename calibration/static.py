"""w8a8: static INT8 with QuantizeLinear/DequantizeLinear nodes, via onnxruntime.quantization.

Ranges come from ONNX Runtime's calibrators (MinMax, Entropy, Percentile) run one feed at a
time (bounded memory, a progress bar) on the activations that feed weight MatMuls only: the
tensors that get quantized, not every MatMul input and output. They are saved with
``save_tensors_data`` and handed to ``quantize_static`` as its calibration cache, so the graph
is quantized from exactly the ranges that the TensorRT tables are written from.

The Q/DQ layout is TensorRT's: symmetric INT8 activations (per tensor) and symmetric INT8
weights (per output channel, axis 1 of the [in, out] weight). ONNX Runtime's CPU provider
fuses the same graph into integer MatMuls, so one graph set serves both.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from collections.abc import Collection
from typing import Callable, Iterable

import numpy as np

from llmx.calibration.matmuls import initializers, read_array, weight_matmuls
from llmx.calibration.quiet import quiet_logging
from llmx.calibration.smoothquant import groups
from llmx.runtime.onnx_backend import session_options

METHODS = ("minmax", "entropy", "percentile")
# Entropy searches thresholds on a 2048-bin histogram of signed values, comparing each clipped
# distribution with its quantized version: 255 levels, the count symmetric INT8 has (ORT's
# default of 128 models 7 bits and clips too hard: perplexity ratio 1.0080 vs 1.0054 on the demo model).
_CALIBRATOR_OPTIONS = {
    "minmax": dict(symmetric=True),
    "entropy": dict(symmetric=True, num_bins=2048, num_quantized_bins=255),
    "percentile": dict(symmetric=True, num_bins=2048, percentile=99.999),
}
INT8_MAX = 127  # symmetric INT8: scale = absmax / 127, as in TensorRT


def _method(name: str):
    from onnxruntime.quantization import CalibrationMethod

    return {"minmax": CalibrationMethod.MinMax, "entropy": CalibrationMethod.Entropy,
            "percentile": CalibrationMethod.Percentile}[name]


def _calibrator(method: str, model_path: Path, tensors: set[str]):
    """An ORT calibrator that watches only ``tensors`` (ORT's own picks every MatMul input and output)."""
    with quiet_logging():
        from onnxruntime.quantization import calibrate

    base = {"minmax": calibrate.MinMaxCalibrater, "entropy": calibrate.EntropyCalibrater,
            "percentile": calibrate.PercentileCalibrater}[method]

    class Selected(base):
        def select_tensors_to_calibrate(self, model):
            found, value_infos = super().select_tensors_to_calibrate(model)
            return found & tensors, value_infos

    augmented = model_path.with_name(f"{model_path.stem}.augmented.onnx")
    calibrator = Selected(str(model_path), ["MatMul"], str(augmented), use_external_data_format=True,
                          **_CALIBRATOR_OPTIONS[method])
    calibrator.augment_graph()
    # What create_inference_session opens (no optimization), without its C++ warnings on stderr
    # (e.g. that decode's logits_to_keep is an initializer and an input, on purpose).
    import onnxruntime as ort

    # Unpacked weights: a few calibration runs do not repay a packed copy of the fp32 model, held
    # beside everything a w8a8 search keeps (its peak on SmolLM2-135M, with feeds.py's prefill).
    options = session_options(optimization="none", prepack=False)
    calibrator.infer_session = ort.InferenceSession(str(augmented), options, providers=calibrator.execution_providers)
    return calibrator


class _OneFeed:
    """A CalibrationDataReader over one feed: the calibrator merges what each call collects."""

    def __init__(self, feed: dict):
        self.feed = feed

    def get_next(self):
        feed, self.feed = self.feed, None
        return feed


def collect_ranges(model_path: Path, feeds: Iterable[dict], method: str,
                   progress: Callable[[int], None] = lambda n: None):
    """Calibrated ranges (ORT TensorsData) of the activations that feed ``model_path``'s weight MatMuls."""
    import onnx

    model = onnx.load_model(str(model_path), load_external_data=False)
    tensors = {mm.activation for mm in weight_matmuls(model)}
    with quiet_logging(), contextlib.redirect_stdout(io.StringIO()):  # the histogram collector prints
        calibrator = _calibrator(method, Path(model_path), tensors)
        for feed in feeds:
            calibrator.collect_data(_OneFeed(feed))
            progress(1)
        ranges = calibrator.compute_data()
    del calibrator
    return ranges


def quantize_qdq(model_path: Path, out_path: Path, ranges, method: str, per_channel: bool = True,
                 skip: Collection[str] = ()) -> None:
    """Write the Q/DQ graph for ``model_path`` quantized with ``ranges`` to ``out_path``.

    MatMuls whose weight is in ``skip`` stay fp32 (the search's fallback).
    """
    import onnx

    model = onnx.load_model(str(model_path), load_external_data=False)
    nodes = [mm.node.name for mm in weight_matmuls(model) if mm.weight not in skip]
    with quiet_logging():
        from onnxruntime.quantization import QuantFormat, QuantType, quantize_static
        from onnxruntime.quantization.calibrate import save_tensors_data

        cache = out_path.with_suffix(".ranges.json")
        save_tensors_data(ranges, cache)
        quantize_static(
            str(model_path), str(out_path), None,
            quant_format=QuantFormat.QDQ,
            op_types_to_quantize=["MatMul"],
            nodes_to_quantize=nodes,
            per_channel=per_channel,
            activation_type=QuantType.QInt8,
            weight_type=QuantType.QInt8,
            calibrate_method=_method(method),
            calibration_cache_path=str(cache),
            use_external_data_format=True,
            extra_options={
                "ActivationSymmetric": True,
                "WeightSymmetric": True,
                "MatMulConstBOnly": True,
                # Inputs only, as TensorRT wants them; ORT fuses DQ->MatMul into MatMulIntegerToFloat.
                "OpTypesToExcludeOutputQuantization": ["MatMul"],
                "QDQOpTypePerChannelSupportToAxis": {"MatMul": 1},
            },
        )


def minmax_ranges(model, absmax: dict[str, np.ndarray], scales: dict[str, np.ndarray] | None = None):
    """MinMax ranges (ORT TensorsData) from per-channel statistics, without running the model.

    ``absmax`` is keyed by weight name; ``scales`` are SmoothQuant's per group (X becomes X / s),
    so every alpha's ranges follow from one statistics pass. Equal to what ORT's symmetric
    MinMax calibrator finds on the same feeds.
    """
    from onnxruntime.quantization.calibrate import CalibrationMethod, TensorData, TensorsData

    per_weight = {w: scales[g.key] for g in groups(model) for w in g.weights if g.key in (scales or {})}
    ranges: dict[str, float] = {}
    for mm in weight_matmuls(model):
        if mm.weight not in absmax:
            continue
        top = float((absmax[mm.weight] / per_weight.get(mm.weight, 1.0)).max())
        ranges[mm.activation] = max(ranges.get(mm.activation, 0.0), top)
    return TensorsData(CalibrationMethod.MinMax, {
        name: TensorData(lowest=np.array(-top, np.float32), highest=np.array(top, np.float32)) for name, top in ranges.items()})


def activation_scales(model, base_dir: Path) -> dict[str, float]:
    """Scale of every quantized activation in a Q/DQ graph, keyed by the tensor it quantizes."""
    inits = initializers(model)
    scales = {}
    for node in model.graph.node:
        if node.op_type == "QuantizeLinear" and node.input[0] not in inits:
            scales[node.input[0]] = float(np.asarray(read_array(inits[node.input[1]], base_dir)).reshape(-1)[0])
    return scales
