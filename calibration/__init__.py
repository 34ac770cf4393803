"""Calibration: INT8/INT4 quantization of artifacts with a measured quality report."""
