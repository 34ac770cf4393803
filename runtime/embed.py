"""Sentence embeddings from an encoder artifact (its one ``embed`` graph) on ONNX Runtime.

Inputs are truncated to the checkpoint's max input length (as sentence-transformers does),
sorted by length and run in batches so padding stays small; results come back in input order.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llmx.artifact.handle import Artifact
from llmx.errors import ArtifactError, InputError
from llmx.runtime.onnx_backend import _ort, session_options
from llmx.runtime.tokenizer import Tokenizer


@dataclass
class Embeddings:
    vectors: np.ndarray  # [N, H] float32
    token_counts: list[int]  # tokens per input after truncation (for usage)


class Embedder:
    def __init__(self, artifact: Artifact, threads: int | None = None, batch_size: int = 32):
        manifest = artifact.manifest
        if manifest.kind != "encoder":
            raise ArtifactError(f"{artifact.root} holds a {manifest.kind} model; embeddings need an encoder artifact")
        ort = _ort()
        self.artifact, self.manifest = artifact, manifest
        self.tokenizer = Tokenizer(artifact)
        model = manifest.model
        self.max_tokens = model.max_input_tokens or model.max_position_embeddings
        self.dim = model.hidden_size
        self.batch_size = batch_size
        graph = artifact.graph("embed")
        path = artifact.graph_path("embed")
        try:
            self.session = ort.InferenceSession(str(path), session_options(threads), providers=["CPUExecutionProvider"])
        except Exception as exc:
            raise ArtifactError(f"ONNX Runtime cannot load {graph.file}: {str(exc).splitlines()[0]}") from exc
        self.pad_id = self.tokenizer.pad_token_id
        self.tokenizer.truncate_to(self.max_tokens)

    @classmethod
    def load(cls, artifact: str | Path | Artifact, **options) -> "Embedder":
        return cls(Artifact.of(artifact), **options)

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        if not texts:
            raise InputError("nothing to embed: input is empty")
        ids = []
        for text in texts:
            if not isinstance(text, str):
                raise InputError("every input must be a string")
            ids.append(self.tokenizer.encode(text))
        return ids

    def embed(self, texts: list[str]) -> Embeddings:
        return self.embed_ids(self.tokenize(texts))

    def embed_ids(self, ids: list[list[int]]) -> Embeddings:
        """Embed token id lists (already tokenized, special tokens included); longer ones are truncated."""
        ids = [t[: self.max_tokens] for t in ids]
        out = np.zeros((len(ids), self.dim), np.float32)
        order = np.argsort([len(t) for t in ids], kind="stable")
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            width = max(len(ids[i]) for i in chunk)
            batch = np.full((len(chunk), width), self.pad_id, np.int64)
            mask = np.zeros_like(batch)
            for row, i in enumerate(chunk):
                batch[row, : len(ids[i])] = ids[i]
                mask[row, : len(ids[i])] = 1
            feed = {"input_ids": batch, "attention_mask": mask, "token_type_ids": np.zeros_like(batch)}
            out[chunk] = self.session.run(None, feed)[0]
        return Embeddings(out, [len(t) for t in ids])
