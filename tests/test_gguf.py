"""GGUF input: files written by the ``gguf`` package from the tiny Llama checkpoint.

fp32: logits match transformers on the original checkpoint. Q8_0/Q4_0/Q4_1: the artifact's
MatMulNBits carry the file's blocks, so its logits (kernel at accuracy_level 0, no activation
rounding) equal the fp32 graph run with the file's dequantized weights, far closer than the
quantization error itself.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from gguf_files import dequantized, write_gguf, write_tokenizer_gguf  # noqa: E402
from test_cli import error_line, leftovers, run  # noqa: E402
from llmx.compact_blocks import rebuilt_tensors  # noqa: E402

QTYPES = ("Q8_0", "Q4_0", "Q4_1")
PROMPT = "class Wrapper(object):\n    def __init__(self, width"


@pytest.fixture(scope="module")
def ggufs(store, tmp_path_factory):
    """qtype -> (gguf path, artifact), written and exported once per module."""
    from llmx.export import export_checkpoint

    root = tmp_path_factory.mktemp("gguf")
    made = {}

    def get(qtype: str) -> tuple[Path, Path]:
        if qtype not in made:
            folder = root / qtype
            folder.mkdir()
            path = write_gguf(store.checkpoint("llama"), folder / f"tiny-{qtype}.gguf", qtype)
            # fp32 goes through the directory form: a folder holding exactly one .gguf.
            export_checkpoint(folder if qtype == "F32" else path, root / f"art-{qtype}")
            made[qtype] = path, root / f"art-{qtype}"
        return made[qtype]

    return get


def session(artifact: Path, graph: str = "prefill", model=None):
    import onnxruntime as ort

    from llmx.artifact.onnx_files import load_graph

    model = model if model is not None else load_graph(artifact / f"{graph}.onnx", with_weights=True)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def prefill_logits(sess, ids: list[int]) -> np.ndarray:
    n = len(ids)
    feeds = {"input_ids": np.array([ids]), "attention_mask": np.ones((1, n), np.int64),
             "position_ids": np.arange(n)[None]}
    return sess.run(["logits"], feeds)[0][0, -1]


def prompt_ids(artifact: Path) -> list[int]:
    from llmx.artifact import Artifact
    from llmx.runtime.tokenizer import Tokenizer

    return Tokenizer(Artifact.open(artifact)).encode(PROMPT)


def test_fp32_gguf_matches_transformers_on_the_original_checkpoint(ggufs, store):
    import torch
    import transformers

    _, artifact = ggufs("F32")  # llama: q/k rows permuted in the file
    ids = prompt_ids(artifact)
    ours = prefill_logits(session(artifact), ids)
    model = transformers.AutoModelForCausalLM.from_pretrained(store.checkpoint("llama")).eval()
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0, -1].numpy()
    assert np.abs(ours - ref).max() <= 1e-4 * max(1.0, np.abs(ref).max())


@pytest.mark.parametrize("variant", ["llama", "qwen2"])  # qwen2: q/k/v biases, no row permutation
def test_gguf_reads_as_the_checkpoint_it_was_written_from(variant, store, tmp_path):
    """Same ModelSpec and the same tensors as the HF directory: the export path is then shared."""
    from safetensors.numpy import load_file

    from llmx.export.checkpoint import open_checkpoint
    from llmx.export.gguf import GGUFTensors, open_gguf
    from llmx.spec import spec_from_hf_config

    checkpoint = open_checkpoint(store.checkpoint(variant))
    source = open_gguf(write_gguf(checkpoint.path, tmp_path / "m.gguf"))
    spec = spec_from_hf_config(source.config())
    assert spec.to_dict() == checkpoint.spec.to_dict()
    ours = GGUFTensors(source, spec.num_heads, spec.num_kv_heads)
    theirs = load_file(str(checkpoint.path / "model.safetensors"))
    assert sorted(ours) == sorted(theirs)
    for name, array in theirs.items():
        np.testing.assert_array_equal(ours[name].numpy(), array, err_msg=name)


def test_gguf_tokenizer_and_chat_template_match_the_checkpoints(ggufs, store):
    from tokenizers import Tokenizer

    _, artifact = ggufs("F32")
    original = Tokenizer.from_file(str(store.checkpoint("llama") / "tokenizer.json"))
    text = "import json\n<|user|>hello  world\t\u00e9t\u00e9 🙂</s>"
    assert prompt_ids(artifact)[0] == 1  # add_bos_token: <s> first
    from llmx.artifact import Artifact
    from llmx.runtime.tokenizer import Tokenizer as Ours

    ours = Ours(Artifact.open(artifact))
    assert ours.encode(text) == original.encode(text).ids
    assert ours.decode(ours.encode(text), skip_special_tokens=False).endswith(text)
    config = json.loads((store.checkpoint("llama") / "tokenizer_config.json").read_text())
    assert ours.chat_template == config["chat_template"]
    assert (ours.bos_token_id, ours.eos_token_ids, ours.pad_token_id) == (1, [2], 0)


def _dequantized_reference(fp32_artifact: Path, spec: dict, qtype: str, store):
    """The fp32 prefill graph holding the weights a ``qtype`` GGUF dequantizes to."""
    import torch
    from onnx import numpy_helper

    from llmx.export.checkpoint import map_weights
    from llmx.artifact.onnx_files import load_graph
    from llmx.spec import ModelSpec

    hf = {k: torch.from_numpy(v) for k, v in dequantized(store.checkpoint("llama"), qtype).items()}
    ours = map_weights(ModelSpec.from_dict(spec), hf)
    model = load_graph(fp32_artifact / "prefill.onnx", with_weights=True)
    replaced = 0
    for init in model.graph.initializer:
        name = init.name.removeprefix("model.")
        if name in ours:
            init.CopyFrom(numpy_helper.from_array(ours[name].numpy(), init.name))
            replaced += 1
    assert replaced >= 2 + 4 * spec["num_layers"]
    return model


def _exact_kernels(artifact: Path):
    """The artifact's prefill with MatMulNBits at accuracy_level 0 (fp32 activations)."""
    from llmx.artifact.onnx_files import load_graph

    model = load_graph(artifact / "prefill.onnx", with_weights=True)
    nbits = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    for node in nbits:
        next(a for a in node.attribute if a.name == "accuracy_level").i = 0
    return model, nbits


@pytest.mark.parametrize("qtype", QTYPES)
def test_quantized_gguf_keeps_its_blocks_no_requantization_error(qtype, ggufs, store):
    from llmx.artifact.manifest import load_manifest

    path, artifact = ggufs(qtype)
    _, fp32 = ggufs("F32")
    manifest = load_manifest(artifact)
    model, nbits = _exact_kernels(artifact)
    layers = manifest.model.num_layers
    assert len(nbits) == 4 * layers + 1  # qkv, o, gate|up, down per layer, and the head
    weights = (artifact / "weights.bin").stat().st_size
    # The embedding is looked up from its blocks, and fp16 scales are stored as fp16.
    assert weights < 1.15 * path.stat().st_size
    assert {a.i for n in nbits for a in n.attribute if a.name in ("bits", "block_size")} == {8 if qtype == "Q8_0" else 4, 32}
    assert (manifest.precision.scheme, manifest.precision.symmetric) == (
        "w8" if qtype == "Q8_0" else "w4", qtype != "Q4_1")

    ids = prompt_ids(artifact)
    ours = prefill_logits(session(artifact, model=model), ids)
    reference = prefill_logits(session(fp32, model=_dequantized_reference(fp32, manifest.model.to_dict(), qtype, store)), ids)
    original = prefill_logits(session(fp32), ids)
    scale = max(1.0, np.abs(reference).max())
    kernel_rounding = np.abs(ours - reference).max()
    quantization_error = np.abs(reference - original).max()
    assert kernel_rounding <= 1e-4 * scale
    assert quantization_error > 100 * kernel_rounding  # the comparison can tell the two apart

    record = manifest.extras["gguf"]
    assert record["file"] == path.name and record["sha256"] == _sha256(path)
    assert record["tensor_types"] == {qtype: 2 + 7 * layers, "F32": 1 + 2 * layers}  # norms stay F32
    assert record["became"] == {qtype: f"{2 + 7 * layers} kept in their blocks (MatMulNBits)",
                                "F32": f"{1 + 2 * layers} float32"}
    assert manifest.lineage[0].details["format"] == "gguf"


def test_mixed_types_keep_each_layout_and_floats_stay_float(store, tmp_path):
    """llama.cpp's mixes give one layer's q, k and v different types: the fused q|k|v matmul becomes
    one MatMulNBits per run of one layout, concatenated; a float tensor keeps its linear fp32."""
    from llmx.export import export_checkpoint

    mixed = {"blk.0.attn_v.weight": "Q5_0", "blk.1.ffn_up.weight": "Q8_0", "output.weight": "F16"}
    path = write_gguf(store.checkpoint("llama"), tmp_path / "mixed.gguf", "Q4_0", overrides=mixed)
    manifest = export_checkpoint(path, tmp_path / "art")
    model, nbits = _exact_kernels(tmp_path / "art")
    bits = {n.input[1].rsplit("_Q", 1)[0]: next(a.i for a in n.attribute if a.name == "bits") for n in nbits}
    assert bits == {
        "model.layers.0.attn.qkv.weight_part0": 4, "model.layers.0.attn.qkv.weight_part1": 8,  # Q4_0 q|k, Q5_0 v
        "model.layers.0.attn.o.weight": 4, "model.layers.0.mlp.up.weight": 4, "model.layers.0.mlp.down.weight": 4,
        "model.layers.1.attn.qkv.weight": 4, "model.layers.1.attn.o.weight": 4, "model.layers.1.mlp.down.weight": 4,
        "model.layers.1.mlp.up.weight_part0": 4, "model.layers.1.mlp.up.weight_part1": 8,  # Q4_0 gate, Q8_0 up
    }  # and no head: F16 stays a float MatMul
    assert sum(n.op_type == "Concat" and n.name.endswith("_concat") for n in model.graph.node) == 2
    record = manifest.extras["gguf"]
    assert record["tensor_types"] == {"Q4_0": 13, "Q5_0": 1, "Q8_0": 1, "F16": 1, "F32": 5}
    assert record["became"]["F16"] == "1 float32"
    assert record["became"]["Q5_0"] == "1 kept in their blocks (MatMulNBits)"

    # The same file dequantized by the gguf package (--precision fp32): the same values in float MatMuls.
    export_checkpoint(path, tmp_path / "fp32", precision="fp32", graphs="fused")
    ids = prompt_ids(tmp_path / "art")
    reference = prefill_logits(session(tmp_path / "fp32"), ids)
    ours = prefill_logits(session(tmp_path / "art", model=model), ids)
    assert np.abs(ours - reference).max() <= 1e-4 * max(1.0, np.abs(reference).max())


def _sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("qtype", QTYPES)
def test_quantized_gguf_artifact_generates(qtype, ggufs, capsys):
    _, artifact = ggufs(qtype)
    # Greedy and past EOS: a random-weight model samples EOS early now and then, which made this flaky.
    code, out, _ = run(["generate", str(artifact), "def f(x):", "--max-new-tokens", "6", "--temperature", "0",
                        "--ignore-eos", "--json"], capsys)
    assert code == 0 and json.loads(out)["completion_tokens"] == 6


def test_unsupported_architecture_is_one_error_line(store, tmp_path, capsys):
    path = write_gguf(store.checkpoint("llama"), tmp_path / "rwkv.gguf", "F32", arch="rwkv6")
    code, _, err = run(["export", str(path), "-o", str(tmp_path / "out")], capsys)
    assert code == 1 and "GGUF architecture 'rwkv6' is not supported" in error_line(err)
    assert leftovers(tmp_path) == ["rwkv.gguf"]


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_corrupt_gguf_is_one_error_line(damage, ggufs, tmp_path, capsys):
    src, _ = ggufs("F32")
    data = src.read_bytes()
    path = tmp_path / "bad.gguf"
    path.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"GGUF" + bytes(range(256)) * 4)
    code, _, err = run(["export", str(path), "-o", str(tmp_path / "out")], capsys)
    assert code == 1 and "cannot read GGUF file bad.gguf" in error_line(err)
    assert leftovers(tmp_path) == ["bad.gguf"]


def test_directory_with_two_ggufs_is_refused(ggufs, tmp_path, capsys):
    src, _ = ggufs("F32")
    for name in ("a.gguf", "b.gguf"):
        shutil.copy(src, tmp_path / name)
    code, _, err = run(["export", str(tmp_path), "-o", str(tmp_path / "out")], capsys)
    assert code == 1 and "holds 2 .gguf files" in error_line(err)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])  # byte-level BPE; SentencePiece BPE with byte fallback
def test_gguf_tokenizers_encode_and_decode_as_transformers_gguf_loader(kind, store, tmp_path):
    import transformers
    from tokenizers import Tokenizer

    from llmx.export.gguf import GGUFSource
    from llmx.export.gguf_tokenizer import package_gguf_tokenizer

    path = write_tokenizer_gguf(tmp_path / "tok.gguf", kind, store.checkpoint("llama"))
    package_gguf_tokenizer(GGUFSource(path, gguf.GGUFReader(str(path))).field, tmp_path)
    ours = Tokenizer.from_file(str(tmp_path / "tokenizer" / "tokenizer.json"))
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in ["import json\n  def f(x):\treturn x", " leading  spaces", "\u00fcn\u00efc\u00f6d\u00e9 \U0001f642 done", "</s>end"]:
        ids = ours.encode(text).ids
        # SentencePiece (and llama.cpp) prefix every run of text with a space, also one that starts
        # with a space or follows a special token; transformers' GGUF loader only a text that does not.
        spm = (" " + text if text.startswith(" ") else text).replace("</s>", "</s> ") if kind == "llama" else text
        assert ids == reference.encode(spm), text
        assert ours.decode(ids, skip_special_tokens=True) == reference.decode(ids, skip_special_tokens=True)


def test_k_quant_mix_computes_the_files_values_in_its_own_blocks(store, tmp_path):
    """Q4_K/Q5_K/Q6_K as llama.cpp mixes them: each kept in its own layout (offsets for the
    asymmetric ones, one MatMulNBits per layout in q|k|v and gate|up, the tied table gathered from
    the head's blocks), computing the gguf package's dequantized values to float32 rounding."""
    from gguf_files import write_kquant_gguf

    from llmx.export import export_checkpoint

    path = write_kquant_gguf(tmp_path / "kmix.gguf", store.checkpoint("llama"))
    manifest = export_checkpoint(path, tmp_path / "art")
    export_checkpoint(path, tmp_path / "fp32", precision="fp32", graphs="fused")
    model, nbits = _exact_kernels(tmp_path / "art")
    layout = {n.input[1].rsplit("_Q", 1)[0]: tuple(a.i for a in n.attribute if a.name in ("bits", "block_size"))
              for n in nbits}
    assert layout["model.layers.0.attn.qkv.weight_part0"] == (4, 32)  # Q4_K q|k
    assert layout["model.layers.0.attn.qkv.weight_part1"] == (8, 16)  # Q6_K v
    assert layout["model.layers.0.attn.o.weight"] == (8, 32)  # Q5_K
    assert layout["model.embed.weight"] == (8, 16)  # the tied Q6_K table: the head reads the embedding's blocks
    inits = {i.name for i in model.graph.initializer}
    assert "model.layers.0.attn.qkv.weight_part0_offsets" in inits and "model.layers.0.attn.qkv.weight_part1_offsets" not in inits
    # Stored in the bits they need and rebuilt at load (llmx/compact_blocks.py): Q6_K's 6-bit codes,
    # the K-quants' scales as an fp16 d per super-block times an integer per block.
    rebuilt = rebuilt_tensors(model)
    assert {"model.embed.weight_Q8", "model.embed.weight_scales", "model.layers.0.attn.qkv.weight_part0_scales"} <= set(rebuilt)
    assert {"model.embed.weight_Q8_low", "model.embed.weight_Q8_high", "model.embed.weight_scales_factors"} <= inits
    assert "model.embed.weight" not in inits
    assert manifest.extras["gguf"]["became"]["Q4_K"] == "8 kept in their blocks (MatMulNBits)"
    size = (tmp_path / "art" / "weights.bin").stat().st_size
    # Was 1.6x: float32 scales beside 4.5-6.6-bit files; the Q4_K/Q5_K offsets stay float32.
    assert size < 1.3 * path.stat().st_size

    ids = prompt_ids(tmp_path / "art")
    reference = prefill_logits(session(tmp_path / "fp32"), ids)
    ours = prefill_logits(session(tmp_path / "art", model=model), ids)
    assert np.abs(ours - reference).max() <= 1e-4 * max(1.0, np.abs(reference).max())
    code_path = prefill_logits(session(tmp_path / "art"), ids)  # accuracy_level 4: int8 activations
    assert np.corrcoef(code_path, reference)[0, 1] > 0.99

    # llmx's runtime rebuilds those tensors itself, once for both graphs (runtime/rebuilt_weights.py),
    # instead of leaving them to ONNX Runtime's constant folding as the plain session above did:
    # the same values, so the same logits.
    import onnxruntime as ort

    from llmx.artifact import Artifact
    from llmx.compact_blocks import REBUILT
    from llmx.runtime.onnx_backend import OrtBackend

    assert manifest.extras[REBUILT]["load_bytes"] > 0
    backend = OrtBackend(Artifact.open(tmp_path / "art"), threads=1, lazy_prefill=False)
    assert set(rebuilt) <= set(backend._rebuilt.arrays)
    opts = ort.SessionOptions()
    graph = backend._rebuilt.prepare(tmp_path / "art" / "prefill.onnx", opts)
    assert isinstance(graph, bytes) and b"_Q8_low" not in graph  # the rebuild nodes are gone
    runtime = prefill_logits(ort.InferenceSession(graph, opts, providers=["CPUExecutionProvider"]), ids)
    np.testing.assert_allclose(runtime, code_path, rtol=0, atol=1e-5 * np.abs(code_path).max())
