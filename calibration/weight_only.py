"""w8 and w4: weight-only quantization of MatMul weights to ONNX Runtime's MatMulNBits.

Weights are quantized in blocks of ``block_size`` input channels per output column (one scale,
and a zero point unless symmetric, per block) by ONNX Runtime's own rounding
(``quant_blocks.quantize_blocks``, the C++ kernels its MatMulNBitsQuantizer calls, which
``llmx export --precision`` calls too): the same operator and layout onnxruntime-genai builds
for its int4 and int8 models. weight_only_builder.py assembles the searched graphs and the
artifact's from those blocks. ``accuracy_level`` 4 lets the CPU kernel multiply in INT8
(activations quantized per block on the fly), which is what makes MatMulNBits fast on CPUs;
without it 8-bit weights are dequantized to fp32 on every call.

Per-MatMul precision (the search's fallback, keyed by weight name): under w8 a ``fallback``
weight stays an fp32 MatMul; under w4 it gets 8-bit instead of 4-bit weights (in blocks of 64, or
the recipe's when larger: weight_only_builder.FALLBACK_BLOCK_8BIT). Both stay fast:
``accuracy_level`` 0 (fp32 compute from INT8 weights) dequantizes the whole weight on every
call and measured 10x slower than the fp32 MatMul and 25x slower than level 4 on this CPU
(576x6144, one row), so no fallback uses it.

Activations are not calibrated: the data drives only the quality report (and AWQ's scales,
applied before this step). Quantized weight names follow the fp32 names (``<weight>_Q4``,
``<weight>_scales``), so prefill and decode get identical tensors that ``save_graphs`` stores once.
"""

from __future__ import annotations

from llmx.calibration.matmuls import LOOKUP, ROW_SCALES
from llmx.quant_blocks import BITS, check_block_size  # noqa: F401 (this stage's names for them)


def lookups_from_blocks(model, row_scales: dict | None = None) -> int:
    """A tied model's lookup (``Gather(axis=1)`` of the head's columns and a Transpose,
    llmx/fused/embedding.py; its own copy since calibration/matmuls.py ``untie_weights``) reads
    the head's MatMulNBits blocks instead, as a streamed w8/w4 export's does: the fp32 table is
    most of a small model's w4 artifact (SmolLM2-135M: 113 of 250 MB), and llama.cpp and
    onnxruntime-genai quantize a tied table with the head too. Only symmetric blocks (the lookup
    dequantizes with the default zero point). A head SmoothQuant or AWQ rescaled holds the table
    times s per hidden channel (``row_scales``: name -> initializer, calibration/smoothquant.py):
    the looked-up rows are divided by it. Returns how many."""
    from llmx.calibration.matmuls import consumers, drop_unused_initializers, initializers
    from llmx.fused.embedding import gather_blocks
    from llmx.fused.graph import GraphBuilder
    from llmx.quant_blocks import NBitsWeight

    inits, users = initializers(model), consumers(model)
    blocks = {n.input[1]: n for n in model.graph.node if n.op_type == "MatMulNBits" and len(n.input) == 3}
    done = 0
    for node in list(model.graph.node):
        if node.op_type != "Gather" or not node.input[0].endswith(LOOKUP):
            continue
        head = node.input[0].removesuffix(LOOKUP)
        nbits = blocks.get(f"{head}_Q8") or blocks.get(f"{head}_Q4")
        after = users.get(node.output[0], [])
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        if axis != 1 or nbits is None or len(after) != 1 or after[0].op_type != "Transpose":
            continue
        scales = (row_scales or {}).get(head + ROW_SCALES)
        a = {x.name: x for x in nbits.attribute}
        weight = NBitsWeight(a["bits"].i, a["block_size"].i, a["K"].i, a["N"].i, [inits[nbits.input[1]], inits[nbits.input[2]]])
        g = GraphBuilder("lookup", prefix=f"{head}{LOOKUP}/")
        rows = gather_blocks(g, weight, node.input[1])
        if scales is not None:
            rows = g.op1("Div", [rows, g.weight(scales)])
        g.op("Identity", [rows], [after[0].output[0]])
        at = list(model.graph.node).index(node)
        for old in (node, after[0]):
            model.graph.node.remove(old)
        for i, new in enumerate(g.nodes):
            model.graph.node.insert(at + i, new)
        model.graph.initializer.extend(t for name, t in g.initializers.items() if name not in inits)
        done += 1
    if done:
        drop_unused_initializers(model)  # the lookup's fp32 copy
    return done
