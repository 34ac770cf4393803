"""Every family llama.cpp writes as GGUF reads back as the checkpoint it was converted from.

The files come from ``gguf_files.write_converted_gguf``, which writes a tiny checkpoint as
llama.cpp's ``convert_hf_to_gguf.py`` writes its family (checked locally against the real
converter: same tensor names, types, shapes, bytes and ``{arch}.*`` metadata for every family
here). Read back, each has the checkpoint's ModelSpec and its tensors; two export end to end
and match transformers on the original checkpoint.

Where a GGUF cannot say a setting, llama.cpp assumes one (Gemma 2/3's attention scale and
sliding-layer pattern, SmolLM3's RoPE-less layers every 4th, no window for StarCoder 2 or
Qwen 3, Qwen3 MoE renormalizing): the checkpoints here take those values, the store's
variant where it already does.
"""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from checkpoints import make_checkpoint  # noqa: E402
from gguf_files import write_converted_gguf  # noqa: E402
from test_cli import error_line, leftovers, run  # noqa: E402
from test_gguf import PROMPT, prefill_logits, session  # noqa: E402

_LOCAL_GLOBAL = ["sliding_attention", "full_attention"]
_LLAMA31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}
_GEMMA3_ROPE = {"sliding_attention": dict(rope_type="default", rope_theta=10000.0),
                "full_attention": dict(rope_type="linear", factor=2.0, rope_theta=1e6)}
# name -> a store variant, or (family, make_checkpoint overrides) for one made here.
CASES: dict[str, str | tuple[str, dict]] = {
    "llama": "llama",
    "llama-tied-llama3rope-bias": "llama-tied-llama3rope-bias",  # rope_freqs with one frequency between the bands
    "llama3.1": ("llama", dict(random_vectors=True, hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                               rope_theta=500000.0, rope_scaling=_LLAMA31)),
    "mixtral": "mixtral",
    "qwen3": ("qwen3", dict(random_vectors=True, head_dim=32)),
    "qwen3_moe": ("qwen3_moe", dict(random_vectors=True, norm_topk_prob=True)),
    "gemma": "gemma",
    "gemma2": ("gemma2", dict(random_vectors=True, head_dim=16, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                              query_pre_attn_scalar=16, sliding_window=8, layer_types=_LOCAL_GLOBAL)),
    "gemma3_text": ("gemma3_text", dict(random_vectors=True, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                                        num_hidden_layers=6, final_logit_softcapping=5.0, tie_word_embeddings=False,
                                        rope_parameters=_GEMMA3_ROPE)),
    "phi3": "phi3",  # LongRoPE
    "granite": "granite",
    "olmo2": "olmo2",
    "smollm3": ("smollm3", dict(random_vectors=True, num_hidden_layers=4, no_rope_layer_interval=4,
                                rope_parameters=dict(rope_type="yarn", factor=4.0, rope_theta=10000.0,
                                                     original_max_position_embeddings=64))),
    "starcoder2": ("starcoder2", dict(random_vectors=True, sliding_window=None)),
    "stablelm-parallel-qkv-bias": "stablelm-parallel-qkv-bias",  # per-head q/k norms stacked
    "phi": ("phi", dict(random_vectors=True)),
    "gpt2": "gpt2",
}


@pytest.fixture(scope="module")
def converted(store, tmp_path_factory):
    """case -> (checkpoint, its GGUF as llama.cpp writes it), each made once."""
    root, made = tmp_path_factory.mktemp("gguf-arch"), {}

    def get(case: str):
        if case not in made:
            found = CASES[case]
            if isinstance(found, str):
                checkpoint = store.checkpoint(found)
            else:
                family, overrides = found
                checkpoint = store.once(f"ckpt/gguf-{case}", lambda path: make_checkpoint(path, family, **overrides))
            made[case] = checkpoint, write_converted_gguf(checkpoint, root / f"{case}.gguf")
        return made[case]

    return get


def _float32s(value):
    """Floats as the float32 a GGUF holds (Phi-3's 1.7000000000000002 is 1.7 there)."""
    if isinstance(value, dict):
        return {k: _float32s(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_float32s(v) for v in value]
    return float(np.float32(value)) if isinstance(value, float) else value


@pytest.mark.parametrize("case", list(CASES))
def test_converted_gguf_reads_as_its_checkpoint(case, converted):
    from safetensors.numpy import load_file

    from llmx.export.checkpoint import open_checkpoint
    from llmx.export.gguf import GGUFTensors, open_gguf
    from llmx.spec import spec_from_hf_config

    path, file = converted(case)
    checkpoint = open_checkpoint(path)
    source = open_gguf(file)
    spec = spec_from_hf_config(source.config())
    assert _float32s(spec.to_dict()) == _float32s(checkpoint.spec.to_dict())
    ours = GGUFTensors(source, spec.num_heads, spec.num_kv_heads)
    theirs = load_file(str(path / "model.safetensors"))
    assert sorted(ours) == sorted(theirs)
    for name, array in theirs.items():
        got = ours[name].numpy()
        if spec.norm_offset and name.endswith("norm.weight"):
            # Gemma's norms went into the file as 1 + w: the weight llmx folds back, offset + w, is exact
            np.testing.assert_array_equal(got + np.float32(spec.norm_offset), array + np.float32(spec.norm_offset), err_msg=name)
        else:
            np.testing.assert_array_equal(got, array, err_msg=name)


@pytest.mark.parametrize("case", ["gemma3_text", "llama3.1"])
def test_converted_gguf_exports_and_matches_transformers(case, converted, tmp_path):
    """Gemma 3 (norms, local RoPE, llama.cpp's attention scale and layer pattern, soft-cap) and
    Llama 3.1's recovered rope scaling, end to end."""
    import torch
    import transformers

    from llmx.artifact import Artifact
    from llmx.export import export_checkpoint
    from llmx.runtime.tokenizer import Tokenizer

    path, file = converted(case)
    export_checkpoint(file, tmp_path / "art")
    ids = Tokenizer(Artifact.open(tmp_path / "art")).encode(PROMPT)
    ours = prefill_logits(session(tmp_path / "art"), ids)
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0, -1].numpy()
    assert np.abs(ours - ref).max() <= 1e-4 * max(1.0, np.abs(ref).max())


def test_quantized_experts_read_their_own_slice(converted, tmp_path):
    """Q8_0 experts stacked [experts, ff, hidden]: each expert's HF name dequantizes its slice only."""
    from llmx.export.gguf import GGUFTensors, open_gguf

    path, _ = converted("qwen3_moe")
    source = open_gguf(write_converted_gguf(path, tmp_path / "q8.gguf", "Q8_0"))
    ours = GGUFTensors(source, 4, 2)
    t = source.tensors["blk.1.ffn_up_exps.weight"]
    whole = gguf.quants.dequantize(t.data, t.tensor_type)
    assert t.tensor_type.name == "Q8_0" and whole.shape == (4, 48, 64)
    for expert in range(4):
        np.testing.assert_array_equal(ours[f"model.layers.1.mlp.experts.{expert}.up_proj.weight"].numpy(), whole[expert])
    assert ours.stored_blocks(["model.layers.1.mlp.experts.0.up_proj.weight"]) is None  # slices are read as floats
    assert ours.stored_blocks(["model.layers.1.self_attn.o_proj.weight"]) is not None


def test_rope_factors_no_llama3_scaling_reproduces_are_one_error_line(converted, tmp_path, capsys):
    from gguf_files import _add_tokenizer

    path, file = converted("llama3.1")
    reader = gguf.GGUFReader(str(file))
    writer = gguf.GGUFWriter(str(tmp_path / "odd.gguf"), "llama")
    for key in ("block_count", "context_length", "embedding_length", "feed_forward_length", "attention.head_count",
                "attention.head_count_kv", "rope.freq_base", "attention.layer_norm_rms_epsilon"):
        found = reader.get_field(f"llama.{key}")
        writer.add_key_value(found.name, found.contents(), found.types[0])
    _add_tokenizer(writer, path)
    for t in reader.tensors:
        data = np.array(t.data)
        writer.add_tensor(t.name, np.linspace(1, 3, data.size, dtype=np.float32) if t.name == "rope_freqs.weight" else data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    code, _, err = run(["export", str(tmp_path / "odd.gguf"), "-o", str(tmp_path / "out")], capsys)
    assert code == 1 and "rope_freqs.weight holds rope factors that no llama3 rope scaling" in error_line(err)
    assert leftovers(tmp_path) == ["odd.gguf"]


def test_llama3_parameters_come_back_from_llama_3_2s_factors():
    """Llama 3.2's scaling (factor 32) over a 64-dim head: the line through the factors between
    the bands gives high_freq_factor and the original length back exactly."""
    from llmx.export.gguf_arch import llama3_factors, llama3_rope

    factors = llama3_factors(500000.0, 64, 32.0, 1.0, 4.0, 8192)
    assert llama3_rope(factors, 500000.0, 64) == {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert llama3_rope(np.ones(32, np.float32), 500000.0, 64) is None
