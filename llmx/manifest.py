"""The artifact manifest, ``llmx.json``: the one contract between stages.

An artifact directory holds graph files, a ``tokenizer/`` folder and this manifest. The
manifest says what the model is (config), which graphs exist and their exact IO, how the KV
cache is laid out, the tokenizer's special tokens, the precision, and a checksum per file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmx import __version__
from llmx.errors import ArtifactError

MANIFEST_NAME = "llmx.json"
SCHEMA_VERSION = 1
KINDS = ("decoder", "encoder")


@dataclass
class TensorSpec:
    name: str
    dtype: str  # numpy dtype name: "float32", "int64", ...
    shape: list[int | str]  # ints are fixed, strings name dynamic axes


@dataclass
class GraphSpec:
    file: str
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    opset: int = 18
    # "portable": standard ONNX ops only (TensorRT reads it); "onnxruntime": uses com.microsoft ops.
    ops: str = "portable"
    external_data: list[str] = field(default_factory=list)

    def input(self, name: str) -> TensorSpec | None:
        return next((t for t in self.inputs if t.name == name), None)


@dataclass
class Manifest:
    kind: str
    model: dict[str, Any]  # the architecture: family, dims, norm, rope, ... (llmx.spec.ModelSpec)
    graphs: dict[str, GraphSpec]
    tokenizer: dict[str, Any]  # files, bos/eos/pad ids, chat template presence
    precision: dict[str, Any]  # weights/activations dtype, quantization scheme and its settings
    kv: dict[str, Any] = field(default_factory=dict)  # layout of past/present tensors (decoders)
    checksums: dict[str, str] = field(default_factory=dict)  # relative path -> sha256
    lineage: list[dict[str, Any]] = field(default_factory=list)  # one entry per stage applied
    extras: dict[str, Any] = field(default_factory=dict)  # stage-specific records (quality, engines)
    schema_version: int = SCHEMA_VERSION
    llmx_version: str = __version__

    # -- serialization -------------------------------------------------------------------

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=False) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Manifest":
        if data.get("schema_version") != SCHEMA_VERSION:
            raise ArtifactError(
                f"manifest schema version {data.get('schema_version')!r} is not supported "
                f"(this llmx reads version {SCHEMA_VERSION})"
            )
        try:
            graphs = {
                name: GraphSpec(
                    **{
                        **g,
                        "inputs": [TensorSpec(**t) for t in g["inputs"]],
                        "outputs": [TensorSpec(**t) for t in g["outputs"]],
                    }
                )
                for name, g in data["graphs"].items()
            }
            manifest = cls(**{**data, "graphs": graphs})
        except (KeyError, TypeError) as exc:
            raise ArtifactError(f"manifest is malformed: {exc}") from exc
        if manifest.kind not in KINDS:
            raise ArtifactError(f"manifest kind {manifest.kind!r} is not one of {KINDS}")
        return manifest

    def save(self, directory: Path) -> None:
        (Path(directory) / MANIFEST_NAME).write_text(self.to_json())

    # -- derived facts ---------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return int(self.model["num_layers"])

    @property
    def max_seq_len(self) -> int:
        return int(self.model["max_position_embeddings"])

    def stage_applied(self, stage: str) -> dict[str, Any] | None:
        return next((s for s in reversed(self.lineage) if s.get("stage") == stage), None)

    def with_stage(self, stage: str, **record: Any) -> "Manifest":
        """A copy with one more lineage entry; stages call this before writing their artifact."""
        copy = dataclasses.replace(self, lineage=[*self.lineage, {"stage": stage, **record}])
        copy.llmx_version = __version__
        return copy


def load_manifest(directory: str | Path) -> Manifest:
    directory = Path(directory)
    path = directory / MANIFEST_NAME
    if not directory.is_dir():
        raise ArtifactError(f"artifact directory {directory} does not exist")
    if not path.is_file():
        raise ArtifactError(f"{directory} is not an llmx artifact (no {MANIFEST_NAME}); run `llmx export` first")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"{path} is not valid JSON: {exc}") from exc
    return Manifest.from_dict(data)


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
    directory = Path(directory)
    bad = []
    for rel, digest in manifest.checksums.items():
        path = directory / rel
        if not path.is_file() or sha256_file(path) != digest:
            bad.append(rel)
    return bad
