"""``Artifact``: one handle on an artifact directory and its manifest.

Every stage, backend and the tokenizer take an ``Artifact`` instead of a directory and a
manifest travelling side by side: the manifest is read and checked once, in ``open``, and
every file it names is resolved through ``file`` (inside the directory and nowhere else).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from llmx.artifact.manifest import Manifest, load_manifest, verify_checksums
from llmx.artifact.paths import artifact_file
from llmx.artifact.sections import GraphSpec
from llmx.errors import ArtifactError


@dataclass(frozen=True)
class Artifact:
    root: Path
    manifest: Manifest

    def __post_init__(self):
        object.__setattr__(self, "root", Path(self.root))  # callers holding a str directory get a Path too

    @classmethod
    def open(cls, path: str | Path) -> "Artifact":
        """The artifact at ``path``; its manifest, every field and every file path, checked."""
        return cls(Path(path), load_manifest(path))

    @classmethod
    def of(cls, artifact: "str | Path | Artifact") -> "Artifact":
        """An ``Artifact`` as is, or opened from a path (for functions that take either)."""
        return artifact if isinstance(artifact, Artifact) else cls.open(artifact)

    def file(self, rel: str, field: str = "file") -> Path:
        """``root / rel``, refused if it resolves outside the artifact; ``field`` names it in errors."""
        return artifact_file(self.root, rel, field)

    def existing_file(self, rel: str, field: str = "file") -> Path:
        """``file(rel)``, refused with one line if it is not there (what a reader opens next)."""
        path = self.file(rel, field)
        if not path.is_file():
            raise ArtifactError(f"{self.root} is missing {rel}")
        return path

    def graph(self, name: str) -> GraphSpec:
        if name not in self.manifest.graphs:
            raise ArtifactError(f"{self.root} has no {name} graph (it has {', '.join(self.manifest.graphs) or 'none'})")
        return self.manifest.graphs[name]

    def graph_path(self, name: str) -> Path:
        return self.file(self.graph(name).file, f"graphs.{name}.file")

    def external_data_files(self) -> list[str]:
        """The weights files (relative paths) the graphs reference, each once."""
        return sorted({rel for g in self.manifest.graphs.values() for rel in (g.external_data or [])})

    def graph_bytes(self) -> dict[str, int]:
        """Bytes each graph needs on disk: its .onnx file plus the external tensors it references."""
        from llmx.artifact.onnx_files import load_graph  # needs the onnx package, which the edge runtime lacks

        sizes = {}
        for name in self.manifest.graphs:
            path = self.graph_path(name)
            model = load_graph(path)
            external = sum(int({e.key: e.value for e in t.external_data}.get("length", 0)) for t in model.graph.initializer)
            sizes[name] = path.stat().st_size + external
        return sizes

    def size_bytes(self) -> int:
        """Bytes of every file in the directory (what copying the artifact moves)."""
        return sum(p.stat().st_size for p in self.root.rglob("*") if p.is_file())

    def changed_files(self) -> list[str]:
        """Files whose content differs from the manifest's checksums (missing ones included)."""
        return verify_checksums(self.root, self.manifest)
