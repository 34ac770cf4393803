"""w8 and w4: weight-only quantization of MatMul weights to ONNX Runtime's MatMulNBits.

Weights are quantized in blocks of ``block_size`` input channels per output column (one scale,
and a zero point unless symmetric, per block) with ``MatMulNBitsQuantizer`` (whose per-weight
rounding ``llmx export --precision`` calls too, through llmx/quant_blocks.py): the same operator
and layout onnxruntime-genai builds for its int4 and int8 models. ``accuracy_level`` 4 lets the
CPU kernel multiply in INT8 (activations quantized per block on the fly), which is what makes
MatMulNBits fast on CPUs; without it 8-bit weights are dequantized to fp32 on every call.

Per-MatMul precision (the search's fallback, keyed by weight name): under w8 a ``fallback``
weight stays an fp32 MatMul; under w4 it gets 8-bit instead of 4-bit weights. Both stay fast:
``accuracy_level`` 0 (fp32 compute from INT8 weights) dequantizes the whole weight on every
call and measured 10x slower than the fp32 MatMul and 25x slower than level 4 on this CPU
(576x6144, one row), so no fallback uses it. ``skip`` weights stay fp32 MatMuls.

Activations are not calibrated: the data drives only the quality report (and AWQ's scales,
applied before this step). Quantized weight names follow the fp32 names (``<weight>_Q4``,
``<weight>_scales``), so prefill and decode get identical tensors that ``save_graphs`` stores once.
"""

from __future__ import annotations

from collections.abc import Collection

from llmx.calibration.matmuls import name_nodes, weight_matmuls
from llmx.calibration.quiet import quiet_logging
from llmx.quant_blocks import BITS, CPU_ACCURACY_LEVEL, check_block_size  # noqa: F401 (this stage's names for them)


def quantize_weights(model, scheme: str, block_size: int, symmetric: bool, fallback: Collection[str] = (),
                     skip: Collection[str] = ()):
    """Replace the weight MatMuls of ``model`` (weights loaded) with MatMulNBits; returns the new model."""
    check_block_size(block_size)
    name_nodes(model)  # the quantizer selects nodes by name; unnamed ones would all match ""
    if scheme == "w8":
        skip = set(skip) | set(fallback)
    matmuls = [mm for mm in weight_matmuls(model) if mm.weight not in skip]
    held = [mm.node.name for mm in matmuls if mm.weight in fallback]
    rest = [mm.node.name for mm in matmuls if mm.weight not in fallback]
    model = _nbits(model, 8, held, block_size, symmetric)
    return _nbits(model, BITS[scheme], rest, block_size, symmetric)


def _nbits(model, bits: int, nodes: list[str], block_size: int, symmetric: bool):
    if not nodes:
        return model
    # The quantizer takes a node if it is included *or* of a quantized op type, so a selection
    # is made by excluding every other MatMul.
    others = [n.name for n in model.graph.node if n.op_type == "MatMul" and n.name not in set(nodes)]
    with quiet_logging():
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

        quantizer = MatMulNBitsQuantizer(
            model,
            bits=bits,
            block_size=block_size,
            is_symmetric=symmetric,
            accuracy_level=CPU_ACCURACY_LEVEL,
            nodes_to_exclude=others,
            op_types_to_quantize=("MatMul",),
        )
        quantizer.process()
    return quantizer.model.model
