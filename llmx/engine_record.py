"""The manifest's ``tensorrt`` section: what ``llmx build`` built and where it can run.

An engine runs only on the TensorRT version that built it and on GPUs of the same compute
capability, so the build records both and the runtime refuses a mismatch with a message that
says to rebuild, instead of TensorRT's deserialization error. Writer: the engine stage
(``llmx build``); readers: the ``tensorrt`` and ``ort-tensorrt`` backends, ``llmx inspect``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from llmx.engine_shapes import BuildLimits, ProfileSpec
from llmx.errors import ArtifactError
from llmx.schema import ArtifactPath, FieldError, render
from llmx.sections import Section

TENSORRT_HINT = "on a machine with an NVIDIA GPU: pip install 'llmx[tensorrt]' tensorrt-cu12 (tensorrt-cu13 for CUDA 13)"
ENGINES_OF_LAYOUT = {"split": ("prefill", "decode"), "shared": ("model",)}


@dataclass
class DeviceRecord(Section):
    """The GPU an engine was built on (llmx.cuda.CudaDevice.record)."""

    name: str
    compute_capability: str  # "8.9"
    memory_bytes: int | None = None

    def check(self, where: str) -> None:
        major, _, minor = self.compute_capability.partition(".")
        if not (major.isdigit() and (minor.isdigit() or not minor)):
            raise FieldError(f"{where}.compute_capability", f"must look like \"8.9\", got {render(self.compute_capability)}")


@dataclass
class EngineFile(Section):
    """One serialized engine and the optimization profiles it was built with."""

    file: ArtifactPath  # the serialized engine
    graph: str  # the manifest graph it was built from
    profiles: list[ProfileSpec] = field(default_factory=list)  # in the order of the engine's profiles
    bytes: int | None = None
    io_dtypes: dict[str, str] = field(default_factory=dict)  # TensorRT's names: FLOAT, HALF, INT64


@dataclass
class TensorRTRecord(Section):
    version: str  # TensorRT version that built the engines
    device: DeviceRecord  # the GPU it was built on (section `tensorrt.device`)
    precision: str  # fp32 | tf32 | fp16 | bf16 | int8 | fp8
    layout: Literal["split", "shared"]  # split: prefill + decode engines; shared: one engine, two profiles
    limits: BuildLimits  # resolved: every field set
    engines: dict[str, EngineFile]  # split: prefill + decode; shared: model
    strongly_typed: bool = True
    int8_source: str | None = None  # "qdq" | "calibration_table"
    timing_cache: dict[str, Any] = field(default_factory=dict)  # where build timings were cached (outside the artifact)
    build_seconds: float = 0.0

    def check(self, where: str) -> None:
        want = set(ENGINES_OF_LAYOUT[self.layout])
        if set(self.engines) != want:
            raise FieldError(f"{where}.engines", f"of the {self.layout} layout must be {' and '.join(sorted(want))}, "
                                                 f"got {render(sorted(self.engines))}")


def parse_cc(cc: str | tuple[int, int]) -> tuple[int, int]:
    if isinstance(cc, tuple):
        return cc
    major, _, minor = str(cc).partition(".")
    return int(major), int(minor or 0)


def check_engine_compatible(record: TensorRTRecord, trt_version: str, device: dict) -> list[str]:
    """Raise ArtifactError if engines built as ``record`` cannot run here; return warnings."""
    built, where = record.version, record.device
    if built != trt_version:
        raise ArtifactError(
            f"engines were built with TensorRT {built}, this machine has {trt_version}; "
            "rebuild them here with `llmx build`"
        )
    if parse_cc(where.compute_capability) != parse_cc(device["compute_capability"]):
        raise ArtifactError(
            f"engines were built for {where.name} (compute capability {where.compute_capability}), "
            f"this GPU is {device['name']} ({device['compute_capability']}); rebuild them here with `llmx build`"
        )
    if where.name != device["name"]:
        # Same architecture: TensorRT loads the engine, but its tactics were timed elsewhere.
        return [f"engines were built on {where.name}, running on {device['name']} (same compute capability)"]
    return []


def llmx_cache_dir() -> Path:
    """Where llmx keeps caches that outlive an artifact (timing caches, ORT TensorRT engines)."""
    if os.environ.get("LLMX_CACHE_DIR"):
        return Path(os.environ["LLMX_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llmx"
