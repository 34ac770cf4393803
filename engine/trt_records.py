"""What a TensorRT build depends on and checks: the precision the GPU can run, the shared
timing cache, and the INT8 calibration table llmx calibrate leaves behind. The record the
build writes (and the runtime's compatibility check) is the contract's: llmx/artifact/tensorrt.py.
All of this is pure Python and tested with fake records.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from llmx.artifact.handle import Artifact
from llmx.artifact.tensorrt import llmx_cache_dir, parse_cc
from llmx.errors import ArtifactError, InputError

# Lowest compute capability that runs each precision in TensorRT.
PRECISION_MIN_CC = {"fp32": (0, 0), "tf32": (8, 0), "fp16": (5, 3), "bf16": (8, 0), "int8": (6, 1), "fp8": (8, 9)}


def default_timing_cache(trt_version: str, device: dict) -> Path:
    """One timing cache per TensorRT version and GPU architecture, shared by every build there:
    tactic timings for the same layer shapes are reused, so rebuilding is much faster."""
    cc = str(device["compute_capability"]).replace(".", "")
    return llmx_cache_dir() / "tensorrt" / f"timing-{trt_version}-sm{cc}.cache"


def major_version(version: str) -> int:
    try:
        return int(str(version).split(".")[0])
    except ValueError as exc:
        raise ArtifactError(f"unreadable TensorRT version {version!r}") from exc


def check_precision_supported(precision: str, device: dict) -> None:
    """Refuse a precision the GPU cannot run (bf16 before Ampere, fp8 before Ada/Hopper)."""
    need = PRECISION_MIN_CC[precision]
    have = parse_cc(device["compute_capability"])
    if have < need:
        raise InputError(
            f"{precision} needs a GPU of compute capability {need[0]}.{need[1]} or newer; "
            f"{device['name']} is {have[0]}.{have[1]}"
        )


# -- INT8 calibration tables -------------------------------------------------------------------

TABLE_NAMES = ("calibration.cache", "calibration.json", "calibration/calibration.cache", "calibration/calibration.json")


def find_calibration_table(artifact: Artifact) -> Path | None:
    """The calibration table an artifact carries, if any.

    llmx calibrate is expected to name it in ``extras.calibration.table`` (a path relative to
    the artifact, ONNX Runtime's ``write_calibration_table`` format); older or other writers
    are found by ``precision.calibration_table`` or by the file names ORT writes.
    """
    calib = artifact.manifest.extras.get("calibration")
    candidates = [calib.get(k) for k in ("table", "cache", "calibration_table")] if isinstance(calib, dict) else []
    candidates += [artifact.manifest.precision.calibration_table, *TABLE_NAMES]
    for rel in candidates:
        if isinstance(rel, str) and (path := artifact.file(rel, "calibration table")).is_file():
            return path
    return None


def read_calibration_table(path: Path) -> dict[str, float]:
    """Tensor name -> absolute range (amax), from any of the formats calibration tools write:

    - ONNX Runtime ``calibration.json``: ``{name: {"lowest": lo, "highest": hi}}`` (or ``[lo, hi]``);
    - ONNX Runtime ``calibration.cache``: ``name value`` per line;
    - TensorRT's own cache: a ``TRT-...`` header, then ``name: <float32 scale as hex>`` (amax = 127 * scale).
    """
    text = Path(path).read_text()
    try:
        if path.suffix == ".json":
            return {k: _amax(v) for k, v in json.loads(text).items()}
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        if lines and lines[0].startswith("TRT-"):
            return {name.strip(): 127.0 * struct.unpack(">f", bytes.fromhex(value.strip()))[0]
                    for name, _, value in (line.rpartition(":") for line in lines[1:])}
        return {name: abs(float(value)) for name, value in (line.rsplit(None, 1) for line in lines)}
    except (ValueError, TypeError, KeyError, struct.error) as exc:
        raise ArtifactError(f"cannot read calibration table {path}: {exc}") from exc


def _amax(value) -> float:
    if isinstance(value, dict):
        value = [value.get("lowest", 0.0), value.get("highest", 0.0)]
    if isinstance(value, (list, tuple)):
        return max(abs(float(_scalar(v))) for v in value)
    return abs(float(_scalar(value)))


def _scalar(v):
    while isinstance(v, (list, tuple)) and len(v) == 1:  # numpy values serialized as [x]
        v = v[0]
    return v
