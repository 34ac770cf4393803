"""Each MatMul's sensitivity to quantization, measured locally in one pass over its calibration rows.

The search keeps the most sensitive MatMuls in higher precision. Ranking them by what each does
to the model's perplexity costs one full evaluation per MatMul: 121 on a 135M model, 27 minutes
on this kind of box. Ranking them by each MatMul's own output error on the sampled calibration
rows (``ActivationStats.rows``) costs one small product per MatMul, seconds in all; the fallback
counts tried after it (search.py ``fewest_fallbacks``) run the whole model, so the count is still
decided by the target, and a ranking mistake costs a fallback more, not a miss.

The error is relative, ||X W - Q(X W)||^2 / ||X W||^2 per row, averaged over rows: MatMuls of every
scale compare, and quiet rows (which a per-tensor INT8 range rounds coarsest) count as loud ones. The
quantized product is run by ONNX Runtime on a one-MatMul graph quantized by the same quantizer
as the real one (MatMulNBits for w8/w4, Q/DQ at the candidate's range for w8a8): INT8
activation rounding and the CPU's own integer arithmetic are in the number, as they are in the
artifact. That matters: on AVX2-only CPUs the int8 GEMM sums u8 x s8 pairs in saturating int16,
an error no numpy model of the rounding shows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from llmx.calibration.smoothquant import groups

if TYPE_CHECKING:
    from llmx.quant_blocks import NBitsWeight


def relative_error(reference: np.ndarray, approx: np.ndarray) -> float:
    reference = reference.astype(np.float64)
    per_row = ((approx - reference) ** 2).sum(-1) / np.maximum((reference ** 2).sum(-1), 1e-30)
    return float(per_row.mean())


def group_keys(model) -> dict[str, str]:
    """weight name -> the key of its MatMul group (how smoothing and AWQ scales are keyed)."""
    return {w: g.key for g in groups(model) for w in g.weights}


PROBE_INPUT = "x"


def probe_model(w: np.ndarray):
    """A graph of one MatMul, x @ w, named as the quantizers expect (input ``x``, node ``probe``)."""
    from onnx import TensorProto, helper, numpy_helper

    k, n = w.shape
    graph = helper.make_graph([helper.make_node("MatMul", [PROBE_INPUT, "w"], ["y"], name="probe")], "probe",
                              [helper.make_tensor_value_info(PROBE_INPUT, TensorProto.FLOAT, ["rows", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", n])],
                              [numpy_helper.from_array(np.ascontiguousarray(w, np.float32), "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def nbits_probe(weight: "NBitsWeight", name: str):
    """A graph of one quantized MatMul, x @ W, from W's MatMulNBits tensors (values inline)."""
    from onnx import TensorProto, helper

    from llmx.quant_blocks import CPU_ACCURACY_LEVEL, nbits_nodes

    tensors = {}
    nodes = nbits_nodes(PROBE_INPUT, "y", weight, name, CPU_ACCURACY_LEVEL, lambda t: tensors.setdefault(t.name, t).name)
    graph = helper.make_graph(nodes, "probe", [helper.make_tensor_value_info(PROBE_INPUT, TensorProto.FLOAT, ["rows", weight.k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", weight.n])],
                              list(tensors.values()))
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=9)


def quantized_product(x: np.ndarray, quantized, threads: int | None) -> np.ndarray:
    """Run a quantized probe (a model, or a graph path) on rows ``x``."""
    from llmx.calibration.judge import session

    return session(quantized, threads).run(["y"], {PROBE_INPUT: np.ascontiguousarray(x, np.float32)})[0]
