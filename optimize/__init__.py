"""Optimize: graph rewrites for ONNX Runtime (fused kernels) and TensorRT engine builds."""
