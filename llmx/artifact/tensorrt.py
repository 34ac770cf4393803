"""The manifest's ``tensorrt`` section: what ``llmx build`` built, for which shapes, and where it can run.

Shapes. With no profile TensorRT fixes every dynamic dimension to 1, so each graph input gets a
(min, opt, max) shape. The graphs name their dynamic axes (``batch``, ``sequence``,
``new_tokens``, ``total_length``, ``capacity``); a range per axis name gives every input's
shapes at once. These are pure functions of the manifest (checked without a GPU): ``llmx
build`` builds engines for them and the ``ort-tensorrt`` and ``tensorrt`` backends read them
back, one source for both. Two layouts: ``split`` (prefill.engine from the prefill graph,
decode.engine from the decode graph) and ``shared`` (one engine from the decode graph with a
prefill-chunk profile and a decode profile, as NVIDIA's GPT-2 demo did: weights on the device
once).

Record. An engine runs only on the TensorRT version that built it and on GPUs of the same
compute capability, so the build records both and the runtime refuses a mismatch with a
message that says to rebuild, instead of TensorRT's deserialization error. Writer: the engine
stage (``llmx build``); readers: the ``tensorrt`` and ``ort-tensorrt`` backends, ``llmx inspect``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from llmx.artifact.schema import ArtifactPath, FieldError, render
from llmx.artifact.sections import GraphSpec, Section
from llmx.errors import ArtifactError, InputError
from llmx.spec import ModelSpec

LAYOUTS = ("split", "shared")
LOGITS_BUDGET = 256 << 20  # bytes of fp32 logits one shared-layout prefill chunk may produce
DEFAULT_MAX_SEQ_LEN, DEFAULT_OPT_SEQ_LEN = 2048, 512


@dataclass(frozen=True)
class BuildLimits(Section):
    """What the engines must accept. ``None`` fields get defaults from the model in ``resolve``;
    the manifest's engine record holds the resolved limits."""

    max_batch: int = 8  # most sequences per call
    max_seq_len: int | None = None  # default: min(model maximum, 2048)
    max_decode_tokens: int = 8  # T of one decode step (speculative drafts, chunked continuation)
    prefill_chunk: int | None = None  # shared layout: prompt tokens per prefill call
    opt_batch: int = 1  # batch size TensorRT tunes kernels for
    opt_seq_len: int | None = None  # default: min(max_seq_len, 512)

    def resolve(self, model: ModelSpec) -> BuildLimits:
        model_max = model.max_position_embeddings
        seq = self.max_seq_len if self.max_seq_len is not None else min(model_max, DEFAULT_MAX_SEQ_LEN)
        if seq < 2 or seq > model_max:
            raise InputError(f"--max-seq-len must be between 2 and the model's maximum {model_max}, got {seq}")
        if self.max_batch < 1:
            raise InputError(f"--max-batch must be at least 1, got {self.max_batch}")
        if not 1 <= self.max_decode_tokens <= seq:
            raise InputError(f"--max-decode-tokens must be between 1 and {seq}, got {self.max_decode_tokens}")
        if not 1 <= self.opt_batch <= self.max_batch:
            raise InputError(f"--opt-batch must be between 1 and --max-batch {self.max_batch}, got {self.opt_batch}")
        chunk = self.prefill_chunk or default_prefill_chunk(self.max_batch, model.vocab_size, seq)
        if not 1 <= chunk <= seq:
            raise InputError(f"--prefill-chunk must be between 1 and {seq}, got {chunk}")
        opt_seq = min(self.opt_seq_len or DEFAULT_OPT_SEQ_LEN, seq)
        return BuildLimits(self.max_batch, seq, self.max_decode_tokens, chunk, self.opt_batch, opt_seq)

    def check(self, where: str) -> None:
        """Recorded limits are resolved: every field a positive integer."""
        for name, value in self.to_dict().items():
            if value is None or value < 1:
                raise FieldError(f"{where}.{name}", f"must be a positive integer, got {value!r}")


def default_prefill_chunk(max_batch: int, vocab_size: int, max_seq_len: int) -> int:
    """Largest power of two (>= 16) whose [max_batch, chunk, vocab] fp32 logits fit LOGITS_BUDGET."""
    fits = LOGITS_BUDGET // max(1, max_batch * vocab_size * 4)
    chunk = 16
    while chunk * 2 <= fits:
        chunk *= 2
    return min(chunk, max_seq_len)


@dataclass
class ProfileSpec(Section):
    """One optimization profile: input name -> [min, opt, max] shapes."""

    name: str
    shapes: dict[str, list[list[int]]]

    def range_of(self, input_name: str, axis: int) -> tuple[int, int]:
        lo, _, hi = self.shapes[input_name]
        return lo[axis], hi[axis]


def axis_ranges(kind: str, limits: BuildLimits) -> dict[str, tuple[int, int, int]]:
    """(min, opt, max) per named axis for one kind of call."""
    seq, batch = limits.max_seq_len, (1, limits.opt_batch, limits.max_batch)
    lengths = (1, limits.opt_seq_len, seq)
    if kind == "prefill":  # the prefill graph: whole prompts, no cache input
        return {"batch": batch, "sequence": lengths}
    if kind == "decode":  # decode steps into a cache of ``capacity`` slots
        return {"batch": batch, "new_tokens": (1, 1, limits.max_decode_tokens), "total_length": lengths, "capacity": lengths}
    if kind == "prefill_chunks":  # prompt chunks through the decode graph (shared layout)
        chunk = limits.prefill_chunk
        return {"batch": batch, "new_tokens": (1, min(chunk, limits.opt_seq_len), chunk), "total_length": lengths, "capacity": lengths}
    raise ValueError(kind)


def graph_profile(name: str, graph: GraphSpec, ranges: dict[str, tuple[int, int, int]]) -> ProfileSpec:
    """Every input of ``graph`` with its dynamic axes replaced by ``ranges``."""
    shapes = {}
    for tensor in graph.inputs:
        if not tensor.shape:
            continue  # a scalar with a default (decode's logits_to_keep): nothing to range, and TensorRT folds it
        triple: list[list[int]] = [[], [], []]
        for dim in tensor.shape:
            if isinstance(dim, int):
                values = (dim, dim, dim)
            elif dim in ranges:
                values = ranges[dim]
            else:
                raise ArtifactError(
                    f"{graph.file} input {tensor.name} has a dynamic axis {dim!r} that llmx build has no range for "
                    f"(known: {', '.join(sorted(ranges))})"
                )
            for i in range(3):
                triple[i].append(int(values[i]))
        shapes[tensor.name] = triple
    return ProfileSpec(name, shapes)


def ort_trt_profile_options(profile: ProfileSpec) -> dict[str, str]:
    """The same profile in ONNX Runtime TensorRT provider syntax (``name:1x2x3,name2:...``)."""
    keys = ("trt_profile_min_shapes", "trt_profile_opt_shapes", "trt_profile_max_shapes")
    return {
        key: ",".join(f"{name}:{'x'.join(map(str, shapes[i]))}" for name, shapes in profile.shapes.items())
        for i, key in enumerate(keys)
    }


# -- the record of a build ----------------------------------------------------------------------
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
