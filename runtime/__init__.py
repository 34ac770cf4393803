"""Runtime: run llmx artifacts (ONNX Runtime backends, KV cache, sampling, generation). No torch."""
