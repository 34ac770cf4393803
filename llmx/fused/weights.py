"""What the fused graph builder asks of its weights: a protocol two very different sources meet.

``optimize/weights.py`` finds them among a portable artifact's initializers (where the
exporter may have merged identical ones, hence the norm/bias anchors); export's streaming
writer (export/streaming.py) wrote every one under its own name and answers the anchored
questions directly. Names are the exported graphs' initializer names (llmx.weight_names.graph_name).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import onnx


class WeightSource(Protocol):
    def get(self, name: str) -> onnx.TensorProto:
        """The initializer ``name`` (its external-data reference kept as is)."""

    def array(self, name: str) -> np.ndarray:
        """The values of weight ``name``."""

    def norm_before(self, matmul_weight: str, name: str, index: int = 0) -> onnx.TensorProto:
        """The norm weight (index 0) or bias (1) ``name`` that feeds the MatMul of ``matmul_weight``."""

    def bias_after(self, matmul_weight: str, name: str) -> onnx.TensorProto | None:
        """The bias ``name`` added to ``matmul_weight``'s output; None if that MatMul has none."""
