"""The artifact manifest, ``llmx.json``: the one contract between stages.

An artifact directory holds graph files, a ``tokenizer/`` folder and this manifest. The
manifest says what the model is (``model``: a ModelSpec), which graphs exist and their exact
IO, how the KV cache is laid out, the tokenizer's special tokens, the precision, the TensorRT
engines built for it, the stages applied (lineage) and a checksum per file. Each section is a
typed object (llmx/artifact/sections.py, llmx/artifact/tensorrt.py); loading checks every field and every
path, and a bad one ends in one error line that names it. docs/artifact.md describes them.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from llmx import __version__
from llmx.artifact.paths import artifact_file
from llmx.artifact.tensorrt import BuildLimits, TensorRTRecord
from llmx.errors import ArtifactError
from llmx.artifact.schema import ArtifactPath, FieldError, from_json, render, to_json
from llmx.artifact.sections import GraphSpec, KVLayout, LineageEntry, Precision, TensorSpec, TokenizerSection
from llmx.spec import ModelSpec

MANIFEST_NAME = "llmx.json"
SCHEMA_VERSION = 2
READABLE_VERSIONS = (1, 2)  # 1: before typed sections (migrated on load, see _from_version_1)
KINDS = ("decoder", "encoder")
GRAPHS_OF_KIND = {"decoder": ("prefill", "decode"), "encoder": ("embed",)}
POSITIVE_MODEL_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                         "intermediate_size", "max_position_embeddings")

__all__ = ["MANIFEST_NAME", "SCHEMA_VERSION", "Manifest", "GraphSpec", "TensorSpec", "KVLayout", "Precision",
           "TokenizerSection", "LineageEntry", "TensorRTRecord", "load_manifest", "parse_manifest"]

# Sections a writer may hand over as plain dicts; Manifest turns them into their types.
_SECTION_TYPES = {"model": ModelSpec, "tokenizer": TokenizerSection, "precision": Precision, "kv": KVLayout,
                  "tensorrt": TensorRTRecord}


@dataclass
class Manifest:
    kind: Literal["decoder", "encoder"]
    model: ModelSpec  # the architecture: family, dims, norm, rope, ... (llmx/spec.py)
    graphs: dict[str, GraphSpec]
    tokenizer: TokenizerSection
    precision: Precision = field(default_factory=Precision)
    kv: KVLayout | None = None  # decoders: layout of past/present tensors
    tensorrt: TensorRTRecord | None = None  # engines built by `llmx build`
    checksums: dict[ArtifactPath, str] = field(default_factory=dict)  # relative path -> sha256
    lineage: list[LineageEntry] = field(default_factory=list)  # one entry per stage applied
    extras: dict[str, Any] = field(default_factory=dict)  # stage reports for people: quality, verify, calibration
    schema_version: int = SCHEMA_VERSION
    llmx_version: str = __version__

    def __post_init__(self) -> None:
        for name, cls in _SECTION_TYPES.items():
            value = getattr(self, name)
            if isinstance(value, dict):
                setattr(self, name, from_json(cls, value, name))
        self.graphs = {k: GraphSpec.parse(g, f"graphs.{k}") if isinstance(g, dict) else g for k, g in self.graphs.items()}
        self.lineage = [LineageEntry.parse(s, f"lineage[{i}]") if isinstance(s, dict) else s
                        for i, s in enumerate(self.lineage)]

    # -- serialization -------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return to_json(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False) + "\n"

    @classmethod
    def from_dict(cls, data: Any) -> "Manifest":
        return parse_manifest(data)

    def save(self, directory: Path) -> None:
        self.schema_version = SCHEMA_VERSION
        self.validate()  # a writer never leaves what a reader would refuse
        (Path(directory) / MANIFEST_NAME).write_text(self.to_json())

    # -- checks across sections ----------------------------------------------------------

    def validate(self) -> None:
        """What field types cannot say: sections agree with each other and with the graphs."""
        model = self.model
        for name in POSITIVE_MODEL_FIELDS:
            if getattr(model, name) < 1:
                raise FieldError(f"model.{name}", f"must be at least 1, got {getattr(model, name)}")
        missing = [g for g in GRAPHS_OF_KIND[self.kind] if g not in self.graphs]
        if missing:
            raise FieldError("graphs", f"of a {self.kind} must include {' and '.join(missing)}")
        self._check_token_ids()
        if self.kind == "decoder":
            self._check_decoder()
        if self.tensorrt is not None:
            self._check_engines(self.tensorrt)

    def _check_token_ids(self) -> None:
        tok, vocab = self.tokenizer, self.model.vocab_size
        ids = {"tokenizer.bos_token_id": tok.bos_token_id, "tokenizer.pad_token_id": tok.pad_token_id,
               **{f"tokenizer.eos_token_ids[{i}]": t for i, t in enumerate(tok.eos_token_ids)}}
        for where, token in ids.items():
            if token is not None and not 0 <= token < vocab:
                raise FieldError(where, f"must be a token id below model.vocab_size {vocab}, got {token}")

    def _check_decoder(self) -> None:
        kv, model = self.kv, self.model
        if kv is None:
            raise FieldError("kv", "is missing (a decoder's KV cache layout)")
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            if getattr(kv, name) != getattr(model, name):
                raise FieldError(f"kv.{name}", f"{getattr(kv, name)} disagrees with model.{name} {getattr(model, name)}")
        for graph_name in ("prefill", "decode"):
            graph = self.graphs[graph_name]
            logits = graph.output("logits")
            if logits is None or not logits.shape or logits.shape[-1] not in (model.vocab_size, "vocab"):
                raise FieldError(f"graphs.{graph_name}.outputs", f"must include logits over model.vocab_size {model.vocab_size}")
            presents = {t.name for t in graph.outputs}
            if not set(kv.present_names()) <= presents:
                raise FieldError(f"graphs.{graph_name}.outputs", f"lack the KV outputs kv.present names ({kv.present_names()[0]}, ...)")
        inputs = {t.name for t in self.graphs["decode"].inputs}
        if not set(kv.past_names()) <= inputs:
            raise FieldError("graphs.decode.inputs", f"lack the KV inputs kv.past names ({kv.past_names()[0]}, ...)")

    def _check_engines(self, record: TensorRTRecord) -> None:
        for name, engine in record.engines.items():
            if engine.graph not in self.graphs:
                raise FieldError(f"tensorrt.engines.{name}.graph", f"names no graph of this artifact, got {render(engine.graph)}")
        if record.limits.max_seq_len > self.max_seq_len:
            raise FieldError("tensorrt.limits.max_seq_len",
                             f"{record.limits.max_seq_len} exceeds model.max_position_embeddings {self.max_seq_len}")

    def files(self) -> list[tuple[str, str]]:
        """(field, relative path) of every file the manifest names."""
        named = [("tokenizer.file", self.tokenizer.file)]
        if self.tokenizer.chat_template:
            named.append(("tokenizer.chat_template", self.tokenizer.chat_template))
        for name, g in self.graphs.items():
            named.append((f"graphs.{name}.file", g.file))
            named += [(f"graphs.{name}.external_data[{i}]", rel) for i, rel in enumerate(g.external_data)]
        if self.tensorrt is not None:
            named += [(f"tensorrt.engines.{name}.file", e.file) for name, e in self.tensorrt.engines.items()]
        if self.precision.calibration_table:
            named.append(("precision.calibration_table", self.precision.calibration_table))
        return named + [(f"checksums key {render(rel)}", rel) for rel in self.checksums]

    # -- derived facts ---------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return self.model.num_layers

    @property
    def max_seq_len(self) -> int:
        """The longest sequence the model takes (its position table)."""
        return self.model.max_position_embeddings

    @property
    def engine_limits(self) -> BuildLimits:
        """The limits the TensorRT engines were built for; without engines, those `llmx build`
        would use by default (the ort-tensorrt provider builds its engines for them)."""
        return self.tensorrt.limits if self.tensorrt is not None else BuildLimits().resolve(self.model)

    def stage_applied(self, stage: str) -> LineageEntry | None:
        return next((s for s in reversed(self.lineage) if s.stage == stage), None)

    def with_stage(self, stage: str, **details: Any) -> "Manifest":
        """A copy with one more lineage entry; stages call this before writing their artifact."""
        new = dataclasses.replace(copy.deepcopy(self), lineage=[*self.lineage, LineageEntry(stage, details)])
        new.llmx_version = __version__
        return new


def parse_manifest(data: Any) -> Manifest:
    """A Manifest from parsed JSON of any readable schema version; FieldError names what is wrong."""
    if not isinstance(data, dict):
        raise FieldError("the manifest", f"must be a JSON object, got {render(data)}")
    version = data.get("schema_version")
    if type(version) is int and version == 1:  # not True, which equals 1
        data = _from_version_1(data)
    elif type(version) is not int or version != SCHEMA_VERSION:
        raise FieldError("schema_version", f"{render(version)} is not supported (this llmx reads "
                         f"{', '.join(map(str, READABLE_VERSIONS))}; a newer llmx wrote it?)")
    manifest = from_json(Manifest, data, "")
    manifest.validate()
    return manifest


def _from_version_1(data: dict) -> dict:
    """Schema 1 -> 2: the TensorRT record moves from extras to its own section, an encoder's
    empty kv becomes null, precision.float is precision.compute_dtype, and the ONNX Runtime
    level `llmx optimize` left in its lineage entry moves onto the graphs it wrote."""
    data = dict(data, schema_version=SCHEMA_VERSION)
    extras = data.get("extras")
    if isinstance(extras, dict) and "tensorrt" in extras:
        data["extras"] = {k: v for k, v in extras.items() if k != "tensorrt"}
        data["tensorrt"] = extras["tensorrt"]
    if data.get("kv") == {}:
        data["kv"] = None
    precision = data.get("precision")
    if isinstance(precision, dict) and "float" in precision:
        data["precision"] = {("compute_dtype" if k == "float" else k): v for k, v in precision.items()}
    lineage, graphs = data.get("lineage"), data.get("graphs")
    last = lineage[-1] if isinstance(lineage, list) and lineage and isinstance(lineage[-1], dict) else {}
    options = last.get("session_options")
    if last.get("stage") == "optimize" and isinstance(options, dict) and isinstance(graphs, dict):
        level = options.get("graph_optimization_level")
        data["graphs"] = {k: dict(g, ort_optimization=level) if isinstance(g, dict) else g for k, g in graphs.items()}
    return data


def load_manifest(directory: str | Path) -> Manifest:
    """The manifest of an artifact directory, every field and file path checked."""
    directory = Path(directory)
    path = directory / MANIFEST_NAME
    if directory.is_file():
        _not_a_directory(directory)
    if not directory.is_dir():
        raise ArtifactError(f"artifact directory {directory} does not exist")
    if not path.is_file():
        raise ArtifactError(f"{directory} is not an llmx artifact (no {MANIFEST_NAME}); run `llmx export` first")
    try:
        artifact_file(directory, MANIFEST_NAME, MANIFEST_NAME)
        data = json.loads(path.read_text())
        manifest = parse_manifest(data)
        for where, rel in manifest.files():
            artifact_file(directory, rel, where)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"{path} is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise ArtifactError(f"{path} is nested too deeply") from exc
    except ArtifactError as exc:
        raise ArtifactError(f"{path}: {exc}") from exc
    return manifest


def _not_a_directory(path: Path) -> None:
    """A file given where an artifact directory belongs: say what it is instead of 'does not exist'."""
    with path.open("rb") as f:
        gguf = f.read(4) == b"GGUF"
    if gguf:
        raise ArtifactError(f"{path} is a GGUF file, not an artifact: export it first with `llmx export {path} -o DIR`")
    raise ArtifactError(f"{path} is a file, not an artifact directory (give the directory, or its {MANIFEST_NAME})")


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def checksum_tree(directory: Path) -> dict[str, str]:
    """sha256 of every file below ``directory`` except the manifest itself."""
    directory = Path(directory)
    return {
        p.relative_to(directory).as_posix(): sha256_file(p)
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != MANIFEST_NAME
    }


def verify_checksums(directory: str | Path, manifest: Manifest) -> list[str]:
    """Names of files whose content differs from the manifest (missing files included)."""
    bad = []
    for rel, digest in manifest.checksums.items():
        path = artifact_file(directory, rel, "checksums key")
        if not path.is_file() or sha256_file(path) != digest:
            bad.append(rel)
    return bad
