"""``llmx build``: an artifact -> an artifact with TensorRT engines (and the graphs they came from).

    plan_build  (pure: precision, KV dtype, engines and their profiles; no TensorRT needed)
    build_artifact
      -> graphs converted to the engine precision (engine/precision.py), saved with weights.bin
      -> one engine per EngineSpec, built by a builder (engine/trt_build.py: Polygraphy)
      -> manifest: tensorrt = TensorRT version, GPU, precision, limits, profiles, engine files,
         timing cache (llmx/artifact/tensorrt.py); kv.dtype = the cache dtype the engines take

The ONNX graphs stay in the output, so ``--backend ort-cuda`` / ``ort-tensorrt`` (and
``ort-cpu``, slowly, for fp16) run the same precision; ``--onnx-only`` stops there.

Precision (``--precision``): TensorRT 11 networks are strongly typed, so reduced precision is
in the graph's dtypes: fp16/bf16 convert the float graph; int8/fp8 come from the Q/DQ graphs
``llmx calibrate`` writes (other float math in fp16). TensorRT 10 can also build INT8 from a
float graph plus a calibration table (weakly typed, per-tensor dynamic ranges).
Expected from ``llmx calibrate`` (read defensively): ``precision.scheme`` ("w8a8" for int8
Q/DQ), standard-domain QuantizeLinear/DequantizeLinear with zero points 0, and optionally
``extras.calibration.table``: a calibration table path in ONNX Runtime's format.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

from llmx.artifact.handle import Artifact
from llmx.artifact.manifest import Manifest
from llmx.artifact.onnx_files import describe_graph, load_graph, save_graphs
from llmx.artifact.staging import copy_tokenizer, finish, staged_artifact
from llmx.artifact.tensorrt import BuildLimits, TensorRTRecord
from llmx.low_precision import convert_graph, lowered_precision, qdq_summary
from llmx.engine.trt_profiles import EngineSpec, engine_specs
from llmx.engine.trt_records import check_precision_supported, find_calibration_table
from llmx.errors import ArtifactError, InputError

PRECISIONS = ("auto", "fp32", "tf32", "fp16", "bf16", "int8", "fp8")
FLOAT_OF = {"fp32": "float32", "tf32": "float32", "fp16": "float16", "bf16": "bfloat16"}
INT8_SCHEMES = ("w8a8", "int8", "qdq-int8")


@dataclass(frozen=True)
class ArtifactFacts:
    """What the source artifact holds that decides how it can be built."""

    float_dtype: str  # dtype of its float tensors / KV cache
    scheme: str | None  # manifest precision.scheme
    qdq: dict  # Q/DQ node counts by type ({"int8": n} / {"fp8": n}); empty for float graphs
    table: str | None  # calibration table, relative to the artifact


@dataclass
class BuildPlan:
    precision: str  # fp32 | tf32 | fp16 | bf16 | int8 | fp8
    convert_to: str | None  # float dtype the graphs are lowered to (None: as they are)
    kv_dtype: str
    strongly_typed: bool
    int8_source: str | None  # "qdq" | "calibration_table"
    calibration_table: str | None
    layout: str
    limits: BuildLimits
    engines: list[EngineSpec]

    def to_dict(self) -> dict:
        data = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("limits", "engines")}
        data["limits"] = self.limits.to_dict()
        data["engines"] = [{"name": e.name, "graph": e.graph, "file": e.file,
                            "profiles": [p.to_dict() for p in e.profiles]} for e in self.engines]
        return data


class EngineBuilder(Protocol):
    version: str  # TensorRT version
    major: int
    device: dict  # GPU record: name, compute_capability, memory_bytes

    def build(self, onnx_path: Path, engine_path: Path, spec: EngineSpec, plan: BuildPlan, log) -> dict: ...

    def timing_cache_record(self) -> dict: ...


def artifact_facts(src: Artifact, engines: bool = True) -> ArtifactFacts:
    """What the build decides from. ``engines`` False (``--onnx-only``): fused graphs are welcome,
    since only ONNX Runtime (``--backend ort-cuda``) will run the converted graphs."""
    manifest = src.manifest
    if manifest.kind != "decoder" or "decode" not in manifest.graphs:
        raise ArtifactError(f"{src.root} is not a decoder artifact with prefill/decode graphs")
    fused = [name for name, g in manifest.graphs.items() if g.ops != "portable"]
    if fused and engines:
        raise ArtifactError(f"{src.root}'s {', '.join(fused)} graph uses ONNX Runtime-only fused ops, which TensorRT cannot "
                            "parse: build from the artifact before `llmx optimize`, or convert it for "
                            "--backend ort-cuda with --onnx-only")
    decode = src.graph_path("decode")
    qdq = qdq_summary(load_graph(decode), base_dir=src.root) if decode.is_file() else {}
    table = find_calibration_table(src)
    return ArtifactFacts(manifest.kv.dtype, manifest.precision.scheme, qdq,
                         table.relative_to(src.root).as_posix() if table else None)


def resolve_precision(requested: str, facts: ArtifactFacts) -> tuple[str, str | None, str | None]:
    """(precision, float dtype to convert the graphs to or None, int8 source) for a request."""
    if requested not in PRECISIONS:
        raise InputError(f"--precision must be one of {', '.join(PRECISIONS)}, got {requested!r}")
    quantized = "fp8" if facts.qdq.get("fp8") else "int8" if facts.qdq.get("int8") else None
    if requested == "auto":
        by_table = "int8" if facts.scheme in INT8_SCHEMES and facts.table else None
        low = {"float16": "fp16", "bfloat16": "bf16"}.get(facts.float_dtype, "fp16")
        requested = quantized or by_table or low
    if quantized and requested != quantized:
        raise InputError(f"the artifact holds {quantized.upper()} Q/DQ graphs: build it with --precision {quantized} "
                         "(or auto), or build the float artifact it was calibrated from")
    if requested in ("int8", "fp8"):
        convert = "float16" if facts.float_dtype == "float32" else None
        if quantized == requested:
            return requested, convert, "qdq"
        if requested == "int8" and facts.table:
            return "int8", None, "calibration_table"
        raise InputError(f"{requested} needs a calibrated artifact with Q/DQ graphs: run `llmx calibrate` first")
    target = FLOAT_OF[requested]
    if facts.float_dtype == target:
        return requested, None, None
    if facts.float_dtype != "float32":
        raise InputError(f"the artifact is already {facts.float_dtype}; build {requested} from its float32 artifact")
    return requested, (None if target == "float32" else target), None


def plan_build(src: str | Path | Artifact, precision: str = "auto", layout: str = "split",
               limits: BuildLimits = BuildLimits(), engines: bool = True) -> BuildPlan:
    """Everything a build will do, decided before any engine is built (``llmx build --dry-run``)."""
    src = Artifact.of(src)
    manifest = src.manifest
    facts = artifact_facts(src, engines)
    resolved, convert, int8_source = resolve_precision(precision, facts)
    limits = limits.resolve(manifest.model)
    return BuildPlan(
        precision=resolved,
        convert_to=convert,
        kv_dtype=convert or facts.float_dtype,
        strongly_typed=int8_source != "calibration_table",
        int8_source=int8_source,
        calibration_table=facts.table if int8_source == "calibration_table" else None,
        layout=layout,
        limits=limits,
        engines=engine_specs(manifest, limits, layout),
    )


def build_artifact(src: str | Path | Artifact, out: str | Path, plan: BuildPlan,
                   builder_factory: Callable[[], EngineBuilder] | None = None, force: bool = False,
                   log: Callable[[str], None] = lambda msg: None) -> Manifest:
    """Write the built artifact to ``out`` (atomically). Without a builder: graphs only."""
    src = Artifact.of(src)
    with staged_artifact(out, overwrite=force) as tmp:
        builder = builder_factory() if builder_factory else None  # after the output check: fail fast
        new = _write_graphs(src, tmp, plan, log)
        copy_tokenizer(src.root, tmp)
        if plan.calibration_table:
            (tmp / plan.calibration_table).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src.file(plan.calibration_table, "calibration table"), tmp / plan.calibration_table)
        if builder is not None:
            new.tensorrt = build_engines(tmp, new, plan, builder, log)
        new = new.with_stage("build", precision=plan.precision, layout=plan.layout,
                             engines=[e.file for e in plan.engines] if builder else [])
        finish(tmp, new)
    return new


def _write_graphs(src: Artifact, tmp: Path, plan: BuildPlan, log) -> Manifest:
    """The graphs in the engine precision, sharing one weights.bin; the manifest that describes them."""
    manifest = src.manifest
    graphs = {name: load_graph(src.graph_path(name)) for name in manifest.graphs}
    if plan.convert_to:
        for name, graph in graphs.items():
            log(f"converting the {name} graph to {plan.convert_to} (norms, softmax and position math stay float32)")
            convert_graph(graph, plan.convert_to, base_dir=src.root)
    save_graphs(graphs, tmp, sources={name: src.root for name in graphs})
    described = {name: describe_graph(load_graph(tmp / spec.file), spec.file, spec.ops) for name, spec in manifest.graphs.items()}
    precision = manifest.precision
    if plan.convert_to:
        precision = lowered_precision(precision, plan.convert_to, weights=not plan.int8_source)
    return dataclasses.replace(
        manifest, graphs=described, kv=dataclasses.replace(manifest.kv, dtype=plan.kv_dtype), precision=precision,
        tensorrt=None, extras=dict(manifest.extras), checksums={},
    )


def build_engines(tmp: Path, manifest: Manifest, plan: BuildPlan, builder: EngineBuilder, log) -> TensorRTRecord:
    """Build every engine of ``plan`` into ``tmp``; the record the manifest keeps."""
    check_precision_supported(plan.precision, builder.device)
    if plan.int8_source == "calibration_table" and builder.major >= 11:
        raise InputError("TensorRT 11 builds INT8 only from Q/DQ graphs, and this artifact has only a calibration "
                         "table: build it with TensorRT 10, or have `llmx calibrate` write Q/DQ graphs")
    start, engines = time.monotonic(), {}
    for spec in plan.engines:
        log(f"building {spec.file}: {plan.precision}, profiles {', '.join(p.name for p in spec.profiles)}")
        onnx_path = tmp / manifest.graphs[spec.graph].file
        info = builder.build(onnx_path, tmp / spec.file, spec, plan, log)
        engines[spec.name] = {"file": spec.file, "graph": spec.graph,
                              "profiles": [p.to_dict() for p in spec.profiles], **info}
    return TensorRTRecord.parse({
        "version": builder.version,
        "device": builder.device,
        "precision": plan.precision,
        "strongly_typed": plan.strongly_typed,
        "int8_source": plan.int8_source,
        "layout": plan.layout,
        "limits": plan.limits.to_dict(),
        "engines": engines,
        "timing_cache": builder.timing_cache_record(),
        "build_seconds": round(time.monotonic() - start, 2),
    }, "tensorrt")
