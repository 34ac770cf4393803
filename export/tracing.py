"""Tracing llmx's torch modules to ONNX: the exporter's settings, shared by the decoder and encoder graphs."""

from __future__ import annotations

import contextlib
import io
import logging
import warnings

import torch

OPSET = 20


def trace(module: torch.nn.Module, args: tuple, inputs: list[str], outputs: list[str], dynamic_shapes,
          optimize: bool = True):
    """torch.onnx.export's ONNXProgram of ``module`` on ``args`` (the exporter's optimizer run if ``optimize``)."""
    with warnings.catch_warnings(), quiet_exporter(), torch.no_grad():
        warnings.simplefilter("ignore")
        return torch.onnx.export(
            module,
            args,
            dynamo=True,
            opset_version=OPSET,
            input_names=inputs,
            output_names=outputs,
            dynamic_shapes=dynamic_shapes,
            optimize=optimize,
            verbose=False,
        )


class quiet_exporter:
    """The exporter logs progress lines with emoji through logging and print; keep the CLI clean."""

    def __enter__(self):
        self._redirect = contextlib.redirect_stdout(io.StringIO())
        self._redirect.__enter__()
        self._level = logging.getLogger("torch.onnx").level
        logging.getLogger("torch.onnx").setLevel(logging.ERROR)

    def __exit__(self, *exc):
        logging.getLogger("torch.onnx").setLevel(self._level)
        self._redirect.__exit__(*exc)


def strip_metadata(model) -> None:
    # The exporter records each node's Python stack trace and module path: large, and it
    # leaks local file paths into artifacts that get shipped.
    for node in model.graph.node:
        del node.metadata_props[:]
    del model.metadata_props[:]
