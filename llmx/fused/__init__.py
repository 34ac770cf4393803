"""The fused ONNX Runtime prefill and decode graphs, written node by node from a ModelSpec.

Core, not a stage: ``llmx optimize`` feeds the builder a portable artifact's initializers
(optimize/weights.py), ``llmx export --graphs fused`` the weights it streams from a checkpoint
(export/streaming.py); both hand it a ``WeightSource``.

    decoder.py   build_graph: prefill/decode with GroupQueryAttention, skip-norms, fused activations
    moe.py       sparse MoE blocks (ONNX Runtime's MoE op)
    graph.py     GraphBuilder: nodes, initializers and IO in a few calls
    weights.py   WeightSource: what the builder asks of wherever the weights are
"""
