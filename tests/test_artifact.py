"""The artifact contract: manifest contents, atomic writes, shared weights, pinned exporter output."""

from __future__ import annotations

import json

import onnx
import pytest

from llmx.artifact.staging import finish, staged_artifact
from llmx.errors import ArtifactError
from llmx.artifact.manifest import MANIFEST_NAME, load_manifest


def test_manifest_describes_graphs_kv_and_tokenizer(llama_artifact):
    m = load_manifest(llama_artifact)
    assert m.kind == "decoder" and m.model.family == "llama"
    decode = m.graphs["decode"]
    names = [t.name for t in decode.inputs]
    assert names[:3] == ["input_ids", "attention_mask", "position_ids"]
    assert names[3:5] == ["past_key_values.0.key", "past_key_values.0.value"]
    assert [t.name for t in decode.outputs][:3] == ["logits", "present.0.key", "present.0.value"]
    past = decode.input("past_key_values.1.value")
    assert past.dtype == "float32" and past.shape == ["batch", m.kv.num_kv_heads, "capacity", m.kv.head_dim]
    assert m.graphs["prefill"].outputs[0].shape == ["batch", 1, m.model.vocab_size]
    assert m.tokenizer.eos_token_ids == [2] and m.tokenizer.bos_token_id == 1
    assert set(m.checksums) >= {"prefill.onnx", "decode.onnx", "weights.bin", "tokenizer/tokenizer.json"}


def test_both_graphs_share_one_weights_file(llama_artifact):
    """Each weight is stored once; prefill and decode point into the same weights.bin."""
    size = (llama_artifact / "weights.bin").stat().st_size
    prefill = onnx.load(str(llama_artifact / "prefill.onnx"), load_external_data=False)
    decode = onnx.load(str(llama_artifact / "decode.onnx"), load_external_data=False)

    def refs(model):
        return {i.name: {e.key: e.value for e in i.external_data} for i in model.graph.initializer if i.external_data}

    p, d = refs(prefill), refs(decode)
    assert p and p == d
    param_bytes = sum(int(r["length"]) for r in p.values())
    assert param_bytes <= size < param_bytes * 1.2


def test_exporter_output_is_pinned(llama_artifact):
    """We export with torch's dynamo exporter at opset 20 and IR version 10 (ORT 1.31 reads <= 13)."""
    model = onnx.load(str(llama_artifact / "decode.onnx"), load_external_data=False)
    assert model.ir_version == 10
    assert [(o.domain, o.version) for o in model.opset_import if o.domain in ("", "ai.onnx")] == [("", 20)]
    names = {i.name for i in model.graph.initializer}
    assert {"model.layers.0.attn.qkv.weight", "model.layers.1.mlp.up.weight", "model.lm_head.weight"} <= names
    assert sum(n.op_type == "ScatterElements" for n in model.graph.node) == 2 * 2  # k and v, 2 layers
    assert not any(n.metadata_props for n in model.graph.node)  # no stack traces with local paths


def test_staged_artifact_leaves_nothing_on_failure(tmp_path):
    out = tmp_path / "art"
    with pytest.raises(RuntimeError):
        with staged_artifact(out) as tmp:
            (tmp / "half.onnx").write_bytes(b"x")
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ArtifactError):
        with staged_artifact(out):
            pass  # no manifest written: refuse to publish
    assert list(tmp_path.iterdir()) == []


def test_manifest_is_the_last_file_and_round_trips(llama_artifact, tmp_path):
    m = load_manifest(llama_artifact)
    with staged_artifact(tmp_path / "copy") as tmp:
        (tmp / "note.txt").write_text("hello")
        finish(tmp, m.with_stage("test", note="x"))
    again = load_manifest(tmp_path / "copy")
    assert again.lineage[-1].to_dict() == {"stage": "test", "note": "x"}
    assert again.checksums == {"note.txt": again.checksums["note.txt"]}
    assert again.graphs == m.graphs


def test_unknown_schema_version_is_a_clear_error(llama_artifact, tmp_path):
    data = json.loads((llama_artifact / MANIFEST_NAME).read_text())
    data["schema_version"] = 99
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(data))
    with pytest.raises(ArtifactError, match="schema_version 99 is not supported"):
        load_manifest(tmp_path)
