"""w8 and w4: weight-only quantization of MatMul weights to ONNX Runtime's MatMulNBits.

Weights are quantized in blocks of ``block_size`` input channels per output column (one scale,
and a zero point unless symmetric, per block) with ``MatMulNBitsQuantizer``: the same operator
and layout onnxruntime-genai builds for its int4 and int8 models. ``accuracy_level`` 4 lets the
CPU kernel multiply in INT8 (activations quantized per block on the fly), which is what makes
MatMulNBits fast on CPUs; without it 8-bit weights are dequantized to fp32 on every call.

Activations are not calibrated: the data drives only the quality report. Quantized weight
names follow the fp32 names (``<weight>_Q4``, ``<weight>_scales``), so prefill and decode get
identical tensors that ``save_graphs`` stores once.
"""

from __future__ import annotations

from llmx.calibration.matmuls import weight_matmuls
from llmx.calibration.quiet import quiet_logging
from llmx.errors import InputError

BITS = {"w8": 8, "w4": 4}
CPU_ACCURACY_LEVEL = 4  # MatMulNBits: compute in INT8 on CPU (genai's CPU default too)


def check_block_size(block_size: int) -> None:
    # MatMulNBits kernels take power-of-two blocks of at least 16 input channels.
    if block_size < 16 or block_size & (block_size - 1):
        raise InputError(f"--block-size must be a power of two, at least 16; got {block_size}")


def quantize_weights(model, scheme: str, block_size: int, symmetric: bool):
    """Replace every weight MatMul of ``model`` (weights loaded) with MatMulNBits; returns the new model."""
    check_block_size(block_size)
    nodes = [mm.node.name for mm in weight_matmuls(model)]
    with quiet_logging():
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

        quantizer = MatMulNBitsQuantizer(
            model,
            bits=BITS[scheme],
            block_size=block_size,
            is_symmetric=symmetric,
            accuracy_level=CPU_ACCURACY_LEVEL,
            nodes_to_include=nodes,
            op_types_to_quantize=("MatMul",),
        )
        quantizer.process()
    return quantizer.model.model
