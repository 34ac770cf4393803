"""Engine: an artifact loaded for generation (backend + tokenizer), the runtime's front door.

The CLI, the server and the benchmarks hold an Engine and never ask which backend is inside:
every backend implements ``runtime.backend.Backend`` (``new_cache``, ``prefill``, ``decode``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from llmx.artifact.handle import Artifact
from llmx.artifact.manifest import Manifest
from llmx.errors import ArtifactError, InputError
from llmx.runtime.backend import Backend
from llmx.runtime.batch import Event
from llmx.runtime.generate import generate
from llmx.runtime.onnx_backend import OrtBackend
from llmx.runtime.ort_device_backend import OrtDeviceBackend
from llmx.runtime.sampling import SamplingParams
from llmx.runtime.sequence import Sequence
from llmx.runtime.tensorrt_backend import TensorRTBackend
from llmx.runtime.tokenizer import Tokenizer

BACKENDS = ("ort-cpu", "ort-cuda", "ort-tensorrt", "tensorrt")


def engine_options(backend: str, threads: int | None, low_memory: bool = False, spin: bool | None = None) -> dict:
    """Engine.load keyword arguments from the backend options (the ONNX Runtime CPU-only ones checked)."""
    if low_memory and backend != "ort-cpu":
        raise InputError(f"--low-memory applies to --backend ort-cpu, not {backend}")
    options = {"threads": threads}
    if spin is not None and backend.startswith("ort-"):  # an ONNX Runtime thread-pool setting
        options["spin"] = spin
    if low_memory:
        options["low_memory"] = True
    return options


def make_backend(artifact: Artifact, name: str, **options) -> Backend:
    if name == "ort-cpu":
        return OrtBackend(artifact, provider="cpu", **options)
    if name in ("ort-cuda", "ort-tensorrt"):
        return OrtDeviceBackend(artifact, provider=name.removeprefix("ort-"), **options)
    if name == "tensorrt":
        return TensorRTBackend(artifact, **options)
    raise InputError(f"backend must be one of {', '.join(BACKENDS)}, got {name!r}")


@dataclass
class Engine:
    artifact: Artifact
    backend: Backend
    tokenizer: Tokenizer

    @classmethod
    def load(cls, artifact: str | Path | Artifact, backend: str = "ort-cpu", **options) -> "Engine":
        artifact = Artifact.of(artifact)
        if artifact.manifest.kind != "decoder":
            raise ArtifactError(f"{artifact.root} holds a {artifact.manifest.kind} model; text generation needs a decoder")
        return cls(artifact, make_backend(artifact, backend, **options), Tokenizer(artifact))

    @property
    def manifest(self) -> Manifest:
        return self.artifact.manifest

    @property
    def max_seq_len(self) -> int:
        return self.backend.max_seq_len

    def encode(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt)

    def generate(self, prompts: list[str], params: SamplingParams | list[SamplingParams], padding: str = "right",
                 on_event: Callable[[Event], None] | None = None) -> list[Sequence]:
        return generate(self.backend, self.tokenizer, [self.encode(p) for p in prompts], params, padding, on_event)
