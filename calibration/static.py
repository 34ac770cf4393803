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
import math
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
    quantized = [mm for mm in weight_matmuls(model) if mm.weight not in skip]
    nodes = [mm.node.name for mm in quantized]
    overrides = weight_scale_overrides(model, Path(model_path).parent, quantized) if per_channel else {}
    with quiet_logging(), vectorized_int8_weights():
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
                "TensorQuantOverrides": overrides,
            },
        )


# ONNX Runtime's quantizer computes a per-channel weight's scales and rounds its values one output
# channel at a time in Python: 204,672 channels on SmolLM2-135M, about 14 s of every Q/DQ graph
# (a w8a8 search writes six, and its sensitivity pass 121 one-MatMul ones). The same arithmetic,
# a whole weight at a time, gives the same bytes (test_calibrate_search: the graphs are equal to
# the quantizer's own): the scales go in through its public TensorQuantOverrides, and its rounding
# function is swapped for a whole-array one while quantize_qdq runs.
WEIGHT_QMAX = 127  # symmetric INT8 per channel: [-127, 127], scale = absmax / 127 (ORT and TensorRT)


def per_channel_scales(w: np.ndarray) -> np.ndarray:
    """float32 scales along axis 1 of ``w`` [in, out], as ONNX Runtime's symmetric INT8 computes
    them (compute_data_quant_params): the range includes 0, (2 absmax in float64) / 254, rounded
    to float32; a range below float32's smallest normal gets scale 1."""
    absmax = np.maximum(np.abs(np.minimum(w.min(axis=0), 0)), np.abs(np.maximum(w.max(axis=0), 0)))
    exact = 2.0 * absmax.astype(np.float64) / (2 * WEIGHT_QMAX)
    scale = exact.astype(np.float32)
    scale[exact < np.finfo(np.float32).tiny] = 1.0
    return scale


def weight_scale_overrides(model, base_dir: Path, matmuls) -> dict[str, list[dict]]:
    """TensorQuantOverrides giving each quantized weight's per-channel (axis 1) scales."""
    inits = initializers(model)
    found = {}
    for mm in matmuls:
        if mm.weight in found:  # one weight read by several MatMuls
            continue
        scales = per_channel_scales(read_array(inits[mm.weight], base_dir)).tolist()
        found[mm.weight] = [{"axis": 1, "scale": scales[0], "zero_point": 0}, *({"scale": v, "zero_point": 0}
                                                                                for v in scales[1:])]
    return found


@contextlib.contextmanager
def vectorized_int8_weights():
    """While quantize_qdq runs: ONNX Runtime's ``quantize_onnx_initializer`` rounds an INT8
    per-channel weight as one array (x / scale, round half to even, + zero point, clipped, as its
    quantize_nparray does per channel); any other call goes to the original."""
    from onnx import TensorProto, numpy_helper
    from onnxruntime.quantization import qdq_quantizer
    from onnxruntime.quantization.quant_utils import TENSOR_NAME_QUANT_SUFFIX

    original = qdq_quantizer.quantize_onnx_initializer

    def fast(weight, quant_type, zero_point, scale, axis=None, quant_weight_name=None, block_size=0):
        if quant_type != TensorProto.INT8 or axis is None or block_size or len(weight.dims) != 2:
            return original(weight, quant_type, zero_point, scale, axis, quant_weight_name, block_size)
        data = numpy_helper.to_array(weight).astype(np.float32, copy=False)
        shape = [1, 1]
        shape[axis] = -1
        q = np.round(data / np.asarray(scale, np.float32).reshape(shape)) + np.asarray(zero_point, np.float32).reshape(shape)
        q = np.clip(q, -128, 127, out=q).astype(np.int8)
        return numpy_helper.from_array(q, quant_weight_name or f"{weight.name}{TENSOR_NAME_QUANT_SUFFIX}")

    qdq_quantizer.quantize_onnx_initializer = fast
    try:
        yield
    finally:
        qdq_quantizer.quantize_onnx_initializer = original


def ranges_from_stats(method: str, model, stats, graph: str, scales: dict[str, np.ndarray] | None = None):
    """``method``'s ranges (ORT TensorsData) for ``model`` (``graph``, smoothed by ``scales`` if
    given) from the activation statistics (activations.py), without running it; None where they
    do not decide them (entropy; percentile without kept top values): run ``collect_ranges``."""
    if method == "minmax":
        return minmax_ranges(model, stats.absmax[graph], scales)
    if method == "percentile" and graph in stats.tops:
        return percentile_ranges(model, stats.tops[graph], stats.seen[graph], scales)
    return None


def _per_weight_scales(model, scales: dict[str, np.ndarray] | None) -> dict[str, np.ndarray]:
    return {w: scales[g.key] for g in groups(model) for w in g.weights if g.key in (scales or {})}


PERCENTILE = _CALIBRATOR_OPTIONS["percentile"]["percentile"]


def percentile_ranges(model, tops: dict[str, np.ndarray], seen: dict[str, int],
                      scales: dict[str, np.ndarray] | None = None, percentile: float = PERCENTILE):
    """Percentile ranges (ORT TensorsData) from each channel's largest |X| (ActivationStats.tops,
    over ``seen`` rows), or None if a range is not decided by them.

    The threshold is the smallest |X / s| with ``percentile`` % of the values at or below it,
    exactly; ONNX Runtime's PercentileCalibrater reads it off a 2048-bin histogram, which puts it
    at the lower edge of the bin that holds it (up to max/2048 lower, depending on the first
    feed's range). The values above it are all among the channels' kept largest whenever no
    channel's smallest kept value exceeds it (then nothing dropped could be above it); that is
    checked, not assumed.
    """
    per_weight = _per_weight_scales(model, scales)
    ranges: dict[str, float] = {}
    for mm in weight_matmuls(model):
        if mm.weight not in tops:
            continue
        kept, rows = tops[mm.weight], seen[mm.weight]  # kept: [in, largest of the rows]
        s = per_weight.get(mm.weight)
        scaled = kept if s is None else kept / s[:, None]
        count = rows * kept.shape[0]
        # the k-th largest is the smallest value with >= percentile % at or below it (rounded: float noise)
        k = count - math.ceil(round(count * percentile / 100, 6)) + 1
        flat = scaled.ravel()
        if k > flat.size:
            return None
        top = float(np.partition(flat, flat.size - k)[flat.size - k])
        if rows > kept.shape[1] and float(scaled.min(1).max()) > top:
            return None
        ranges[mm.activation] = max(ranges.get(mm.activation, 0.0), top)
    return symmetric_ranges("percentile", ranges)


def minmax_ranges(model, absmax: dict[str, np.ndarray], scales: dict[str, np.ndarray] | None = None):
    """MinMax ranges (ORT TensorsData) from per-channel statistics, without running the model.

    ``absmax`` is keyed by weight name; ``scales`` are SmoothQuant's per group (X becomes X / s),
    so every alpha's ranges follow from one statistics pass. Equal to what ORT's symmetric
    MinMax calibrator finds on the same feeds.
    """
    per_weight = _per_weight_scales(model, scales)
    ranges: dict[str, float] = {}
    for mm in weight_matmuls(model):
        if mm.weight not in absmax:
            continue
        top = float((absmax[mm.weight] / per_weight.get(mm.weight, 1.0)).max())
        ranges[mm.activation] = max(ranges.get(mm.activation, 0.0), top)
    return symmetric_ranges("minmax", ranges)


def symmetric_ranges(method: str, tops: dict[str, float]):
    """ORT TensorsData of ``method`` giving each tensor the range [-top, top]."""
    from onnxruntime.quantization.calibrate import TensorData, TensorsData

    return TensorsData(_method(method), {
        name: TensorData(lowest=np.array(-top, np.float32), highest=np.array(top, np.float32)) for name, top in tops.items()})


def activation_scales(model, base_dir: Path) -> dict[str, float]:
    """Scale of every quantized activation in a Q/DQ graph, keyed by the tensor it quantizes."""
    inits = initializers(model)
    scales = {}
    for node in model.graph.node:
        if node.op_type == "QuantizeLinear" and node.input[0] not in inits:
            scales[node.input[0]] = float(np.asarray(read_array(inits[node.input[1]], base_dir)).reshape(-1)[0])
    return scales
