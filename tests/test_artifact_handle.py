"""The Artifact handle: one object for a directory and its checked manifest."""

from __future__ import annotations

import json
import os
import shutil

import onnx
import pytest

from llmx.artifact import Artifact
from llmx.artifact.manifest import MANIFEST_NAME
from llmx.errors import ArtifactError


def test_open_reads_the_manifest_once_and_resolves_graphs(llama_artifact):
    art = Artifact.open(llama_artifact)
    assert art.root == llama_artifact and art.manifest.kind == "decoder"
    assert art.graph_path("decode") == llama_artifact / "decode.onnx"
    assert art.file("tokenizer/tokenizer.json").is_file()
    assert Artifact.of(art) is art and Artifact.of(str(llama_artifact)).manifest == art.manifest


def test_graph_bytes_count_the_graph_file_and_its_external_tensors(llama_artifact):
    art = Artifact.open(llama_artifact)
    sizes = art.graph_bytes()
    assert set(sizes) == {"prefill", "decode"}
    decode = onnx.load(str(llama_artifact / "decode.onnx"), load_external_data=False)
    external = sum(int({e.key: e.value for e in t.external_data}["length"]) for t in decode.graph.initializer if t.external_data)
    assert external > 0 and sizes["decode"] == (llama_artifact / "decode.onnx").stat().st_size + external
    # Both graphs read the one weights.bin: together they count it twice, the directory once.
    weights = (llama_artifact / "weights.bin").stat().st_size
    assert art.size_bytes() < sizes["prefill"] + sizes["decode"] + weights


def test_a_missing_graph_and_a_path_outside_are_one_error(llama_artifact):
    art = Artifact.open(llama_artifact)
    with pytest.raises(ArtifactError, match="has no embed graph"):
        art.graph_path("embed")
    with pytest.raises(ArtifactError, match="inside the artifact|outside"):
        art.file("../" + llama_artifact.name + "/llmx.json")


def test_changed_files_names_what_differs_from_the_checksums(llama_artifact, tmp_path):
    copy = tmp_path / "art"
    shutil.copytree(llama_artifact, copy)
    art = Artifact.open(copy)
    assert art.changed_files() == []
    with open(copy / "tokenizer" / "tokenizer.json", "a") as f:
        f.write(" ")
    os.remove(copy / "decode.onnx")
    assert sorted(art.changed_files()) == ["decode.onnx", "tokenizer/tokenizer.json"]


def test_open_refuses_a_directory_without_a_manifest(tmp_path):
    with pytest.raises(ArtifactError, match="not an llmx artifact"):
        Artifact.open(tmp_path)
    (tmp_path / MANIFEST_NAME).write_text(json.dumps({"schema_version": 2}))
    with pytest.raises(ArtifactError):
        Artifact.open(tmp_path)
