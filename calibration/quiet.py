"""Run onnxruntime.quantization without its log noise.

Importing ``matmul_nbits_quantizer`` calls ``logging.basicConfig(level=INFO)`` and the static
quantizer logs a line per tensor; the CLI's output should be the progress bar and the report.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator


@contextlib.contextmanager
def quiet_logging() -> Iterator[None]:
    root = logging.getLogger()
    level, handlers, disabled = root.level, list(root.handlers), logging.root.manager.disable
    logging.disable(logging.WARNING)  # whatever levels the library sets on its loggers
    try:
        yield
    finally:
        logging.disable(disabled)
        for handler in root.handlers[:]:
            if handler not in handlers:
                root.removeHandler(handler)
        root.setLevel(level)
