"""The typed manifest: what loads, what is refused and how, and schema-1 artifacts still load."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from llmx.artifact.paths import artifact_file
from llmx.errors import ArtifactError
from llmx.artifact.manifest import MANIFEST_NAME, SCHEMA_VERSION, load_manifest, parse_manifest
from llmx.runtime.engine import Engine
from llmx.runtime.sampling import SamplingParams
from llmx.artifact.schema import ArtifactPath, FieldError, convert
from test_cli import error_line, run

V1 = Path(__file__).parent / "data" / "manifest_v1.json"  # written by llmx before typed sections (schema 1)


@pytest.fixture
def art(llama_artifact, tmp_path) -> Path:
    dst = tmp_path / "art"
    shutil.copytree(llama_artifact, dst)
    return dst


def edit(art: Path, change) -> None:
    data = json.loads((art / MANIFEST_NAME).read_text())
    result = change(data)
    data = result if isinstance(result, list) else data  # else the change edited data in place
    (art / MANIFEST_NAME).write_text(json.dumps(data))


def test_a_schema_1_artifact_loads_and_generates(art):
    """The same tiny llama written the old way: kv.get("dtype") defaults, session level in the lineage."""
    old = json.loads(V1.read_text())
    assert old["schema_version"] == 1
    old["lineage"].append({"stage": "optimize", "session_options": {"graph_optimization_level": "basic"}})
    old["extras"]["tensorrt"] = None  # schema 1 kept the engine record under extras
    (art / MANIFEST_NAME).write_text(json.dumps(old))
    manifest = load_manifest(art)
    assert manifest.schema_version == SCHEMA_VERSION and manifest.kv.dtype == "float32"
    assert manifest.tensorrt is None and "tensorrt" not in manifest.extras
    assert {g.ort_optimization for g in manifest.graphs.values()} == {"basic"}
    assert manifest.lineage[0].stage == "export" and manifest.lineage[0].details["prefill_logits"] == "last"
    engine = Engine.load(art, threads=1)
    seq = engine.generate(["def"], SamplingParams(max_new_tokens=3, temperature=0))[0]
    assert len(seq.output_ids) == 3


def test_a_schema_1_encoder_and_engine_record_migrate():
    old = json.loads(V1.read_text())
    old["kv"], old["kind"] = {}, "encoder"
    old["graphs"] = {"embed": old["graphs"]["prefill"]}
    old["precision"]["float"] = "float16"
    manifest = parse_manifest(old)
    assert manifest.kv is None and manifest.precision.compute_dtype == "float16"


def test_a_manifest_round_trips_through_its_json(llama_artifact):
    manifest = load_manifest(llama_artifact)
    again = parse_manifest(json.loads(manifest.to_json()))
    assert again == manifest


@pytest.mark.parametrize("change, message", [
    (lambda d: [], "the manifest must be a JSON object, got []"),
    (lambda d: d["model"].update(vocab_size="abc"), 'model.vocab_size must be an integer, got "abc"'),
    (lambda d: d.update(tokenizer=None), "tokenizer must be an object, got null"),
    (lambda d: d["model"].pop("hidden_size"), "model.hidden_size is missing"),
    (lambda d: d["model"].update(norm_eps=True), "model.norm_eps must be a number, got true"),
    (lambda d: d["model"].update(num_layers=10**20), "model.num_layers is out of range, got 100000000000000000000"),
    (lambda d: d["kv"].update(dtype="float64"), 'kv.dtype must be one of "float32", "float16", "bfloat16", "int8", got "float64"'),
    (lambda d: d["kv"].update(past="past.{layer}"), "kv.past must name tensors with {i} and {kv} only"),
    (lambda d: d["kv"].update(num_layers=3), "kv.num_layers 3 disagrees with model.num_layers 2"),
    (lambda d: d["graphs"].pop("decode"), "graphs of a decoder must include decode"),
    (lambda d: d["graphs"]["decode"].update(file="../../etc/passwd"), "graphs.decode.file must stay inside the artifact"),
    (lambda d: d["graphs"]["decode"]["inputs"].insert(0, []), "graphs.decode.inputs[0] must be an object, got []"),
    (lambda d: d["tokenizer"].update(chat_template="../../../../etc/hostname"), "tokenizer.chat_template must stay inside"),
    (lambda d: d["tokenizer"].update(file="/etc/passwd"), 'tokenizer.file must be a relative path inside the artifact, got "/etc/passwd"'),
    (lambda d: d["tokenizer"].update(eos_token_ids=[320]), "tokenizer.eos_token_ids[0] must be a token id below model.vocab_size 320"),
    (lambda d: d["checksums"].update({"../x": "0"}), 'checksums key "../x" must stay inside the artifact'),
    (lambda d: d["lineage"].append({"note": "no stage"}), "lineage[1].stage is missing"),
    (lambda d: d.update(schema_version=3), "schema_version 3 is not supported (this llmx reads 1, 2"),
    (lambda d: d.update(schema_version=True), "schema_version true is not supported"),
])
def test_a_bad_manifest_is_one_error_line_naming_the_field(art, capsys, change, message):
    edit(art, change)
    code, _, err = run(["generate", str(art), "hi", "--max-new-tokens", "1"], capsys)
    assert code != 0 and error_line(err).startswith(f"error: {art / MANIFEST_NAME}: {message}")


def test_a_symlink_out_of_the_artifact_is_refused(art, tmp_path, capsys):
    secret = tmp_path / "secret.json"
    secret.write_text("{}")
    (art / "tokenizer" / "tokenizer.json").unlink()
    (art / "tokenizer" / "tokenizer.json").symlink_to(secret)
    code, _, err = run(["inspect", str(art)], capsys)
    assert code != 0 and 'tokenizer.file "tokenizer/tokenizer.json" is a symlink that points outside the artifact' in error_line(err)
    with pytest.raises(ArtifactError, match="points outside"):
        artifact_file(art, "tokenizer/tokenizer.json")


def test_a_symlink_inside_the_artifact_is_fine(art):
    (art / "weights.bin").rename(art / "real.bin")
    (art / "weights.bin").symlink_to("real.bin")
    assert artifact_file(art, "weights.bin") == art / "weights.bin"
    load_manifest(art)


def test_writers_are_held_to_the_contract(llama_artifact, tmp_path):
    manifest = load_manifest(llama_artifact)
    manifest.kv.num_kv_heads = 3
    with pytest.raises(FieldError, match="kv.num_kv_heads 3 disagrees"):
        manifest.save(tmp_path)
    assert not (tmp_path / MANIFEST_NAME).exists()


@pytest.mark.parametrize("tp, value, ok", [
    (int, 3, True), (int, True, False), (int, 3.0, False), (int, 2**60, False),
    (float, 3, True), (float, float("inf"), False), (bool, 1, False), (str, None, False),
    (int | None, None, True), (int | str, "batch", True), (int | str, 1.5, False),
    (list[int], [1, "a"], False), (dict[str, int], [], False),
    (ArtifactPath, "tokenizer/tokenizer.json", True), (ArtifactPath, "a/../../b", False), (ArtifactPath, "", False),
])
def test_types_come_from_the_annotations(tp, value, ok):
    if ok:
        convert(tp, value, "x")
    else:
        with pytest.raises(FieldError):
            convert(tp, value, "x")


def test_a_null_default_is_valid_however_the_field_is_annotated():
    """A field written ``x: float = None`` (a later ModelSpec field, say) still loads at its default."""
    import dataclasses

    from llmx.artifact.schema import from_json

    @dataclasses.dataclass
    class Section:
        scale: float = None  # type: ignore[assignment]

    assert from_json(Section, {"scale": None}, "s").scale is None
    with pytest.raises(FieldError, match='s.scale must be a number, got "x"'):
        from_json(Section, {"scale": "x"}, "s")
