"""Optimize (``llmx optimize``): fused ONNX Runtime graphs built from the ModelSpec."""
