"""The manifest's sections as typed objects, each with the one place for its defaults.

Written by the stage named on each class, read by the stages after it; docs/artifact.md
describes every field (a test keeps it in step with these classes). Field types are checked
when an artifact loads (llmx/artifact/schema.py); ``check`` methods add what a type cannot say.
"""

from __future__ import annotations

import string
from dataclasses import dataclass, field
from typing import Any, Literal

from llmx.artifact.schema import ArtifactPath, FieldError, from_json, render, to_json

KV_DTYPES = ("float32", "float16", "bfloat16", "int8")
ORT_LEVELS = ("none", "basic", "extended", "all")


class Section:
    """JSON in and out for a section dataclass."""

    @classmethod
    def parse(cls, data: Any, field_name: str = "") -> Any:
        return from_json(cls, data, field_name)

    def to_dict(self) -> dict[str, Any]:
        return to_json(self)


@dataclass
class TensorSpec(Section):
    """One graph input or output. Writer: whichever stage wrote the graph (describe_graph)."""

    name: str
    dtype: str  # numpy dtype name: "float32", "int64", ...
    shape: list[int | str]  # ints are fixed, strings name dynamic axes


@dataclass
class GraphSpec(Section):
    """One ONNX graph of the artifact and its exact IO."""

    file: ArtifactPath
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    opset: int = 18
    # "portable": standard ONNX ops only (TensorRT reads it); "onnxruntime": uses com.microsoft ops.
    ops: Literal["portable", "onnxruntime"] = "portable"
    external_data: list[ArtifactPath] = field(default_factory=list)
    # ONNX Runtime graph optimization level this graph wants (None: "all"). `llmx optimize` writes
    # "basic": its graphs are fused already, and ORT's passes would only cost load time.
    ort_optimization: Literal["none", "basic", "extended", "all"] | None = None

    def input(self, name: str) -> TensorSpec | None:
        return next((t for t in self.inputs if t.name == name), None)

    def output(self, name: str) -> TensorSpec | None:
        return next((t for t in self.outputs if t.name == name), None)


@dataclass
class TokenizerSection(Section):
    """The tokenizer files and special tokens. Writer: export; readers: runtime, calibrate."""

    file: ArtifactPath  # tokenizer.json (the `tokenizers` library reads it)
    vocab_size: int | None = None  # with added tokens; may be smaller than the model's
    bos_token_id: int | None = None  # prepended by the tokenizer's post-processor, if any
    eos_token_ids: list[int] = field(default_factory=list)  # generation stops at any of them
    pad_token_id: int | None = None  # fills padded positions (0 when null)
    bos_token: str | None = None  # its text, for chat templates
    eos_token: str | None = None  # its text, for chat templates
    chat_template: ArtifactPath | None = None  # a Jinja file, as transformers renders it


@dataclass
class KVLayout(Section):
    """How past/present tensors are named and laid out (decoders). Writer: export (dtype:
    calibrate's int8 cache, build's fp16/bf16); readers: every backend, calibrate."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: Literal["float32", "float16", "bfloat16", "int8"] = "float32"
    layout: str = "batch,kv_heads,sequence,head_dim"
    past: str = "past_key_values.{i}.{kv}"  # input names; {i} is the layer, {kv} key or value
    present: str = "present.{i}.{kv}"  # output names
    # A token at position p is stored in slot p; decode scatters new entries at position_ids,
    # so past and present may (and should) be bound to the same buffer.
    update: str = "scatter_at_position"
    quantization: dict[str, Any] | None = None  # int8: how the scales were calibrated (kv_int8.kv_record)

    def check(self, where: str) -> None:
        for name in ("past", "present"):
            fields = {f for _, f, _, _ in string.Formatter().parse(getattr(self, name)) if f is not None}
            if fields != {"i", "kv"}:
                raise FieldError(f"{where}.{name}", f"must name tensors with {{i}} and {{kv}} only, got {render(getattr(self, name))}")

    def past_names(self) -> list[str]:
        return [self.past.format(i=i, kv=s) for i in range(self.num_layers) for s in ("key", "value")]

    def present_names(self) -> list[str]:
        return [self.present.format(i=i, kv=s) for i in range(self.num_layers) for s in ("key", "value")]


@dataclass
class Precision(Section):
    """What the weights, activations and math are stored and run in. Writers: export (fp32),
    calibrate (scheme and its settings), build (lowered float dtype); readers: optimize,
    calibrate, build and the ONNX Runtime backend (--low-memory)."""

    weights: str = "float32"  # float32 | float16 | bfloat16 | int8 | int4
    activations: str = "float32"  # float32 | int8 (w8a8: static Q/DQ activations)
    scheme: str | None = None  # w8a8 | w8 | w4 (calibrate); None: not quantized
    kv_cache: str | None = None  # "int8" when calibrate quantized the KV cache
    compute_dtype: str | None = None  # build: the float dtype non-quantized math runs in ("float" in schema 1)
    method: str | None = None  # w8a8: activation range method
    smoothquant: float | None = None  # SmoothQuant alpha (w8a8; w8/w4: before MatMulNBits' int8 activations)
    per_channel: bool | None = None  # w8a8: per-channel weight scales
    symmetric: bool | None = None  # no zero points
    block_size: int | None = None  # w8/w4: input channels per scale
    accuracy_level: int | None = None  # w8/w4: MatMulNBits' accuracy_level (0: float math, 4: int8 activations)
    awq: bool | None = None  # w4: activation-aware per-input-channel scales before rounding
    fallback: list[str] | None = None  # calibrate's search: MatMuls (weight names) kept in higher precision
    calibration_table: ArtifactPath | None = None  # an INT8 calibration table (ONNX Runtime format)
    data: dict[str, Any] | None = None  # calibrate: the text it was calibrated on (source, sha256, windows)


@dataclass
class LineageEntry(Section):
    """One stage applied to the artifact, oldest first. Writer: every stage (Manifest.with_stage)."""

    __json_rest__ = "details"  # on disk the details sit beside "stage" in one object

    stage: str  # export | optimize | calibrate | kv-int8 | build
    details: dict[str, Any] = field(default_factory=dict)  # what the stage recorded: source, options
