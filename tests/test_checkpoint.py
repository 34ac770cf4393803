"""Checkpoint formats export the same model: sharded safetensors, pytorch_model.bin, fp16 weights,
and GPT-2 tokenizers given as vocab.json + merges.txt."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from llmx.export import export_checkpoint
from llmx.runtime.engine import Engine
from llmx.runtime.sampling import SamplingParams

GREEDY = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_llama(store):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(store.checkpoint("llama")).eval()


def resave(hf_model, src, dst, **save_kwargs):
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.bin", "*.index.json"))
    hf_model.save_pretrained(dst, **save_kwargs)
    return dst


def tokens_of(artifact):
    return Engine.load(artifact, threads=1).generate(["def f(x):"], GREEDY)[0].output_ids


@pytest.fixture(scope="module")
def baseline(store):
    return tokens_of(store.artifact("llama"))


def test_sharded_safetensors(store, hf_llama, baseline, tmp_path):
    ckpt = resave(hf_llama, store.checkpoint("llama"), tmp_path / "sharded", max_shard_size="40KB")
    assert (ckpt / "model.safetensors.index.json").is_file()
    assert len(list(ckpt.glob("model-*.safetensors"))) > 1
    export_checkpoint(ckpt, tmp_path / "art")
    assert tokens_of(tmp_path / "art") == baseline


def test_pytorch_model_bin(store, hf_llama, baseline, tmp_path):
    ckpt = tmp_path / "bin"
    shutil.copytree(store.checkpoint("llama"), ckpt, ignore=shutil.ignore_patterns("*.safetensors"))
    torch.save(hf_llama.state_dict(), ckpt / "pytorch_model.bin")
    export_checkpoint(ckpt, tmp_path / "art")
    assert tokens_of(tmp_path / "art") == baseline


def test_half_precision_weights_are_exported_in_fp32(store, hf_llama, tmp_path):
    import transformers

    ckpt = resave(hf_llama.to(torch.bfloat16), store.checkpoint("llama"), tmp_path / "bf16")
    hf_llama.to(torch.float32)
    export_checkpoint(ckpt, tmp_path / "art")
    ref = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    engine = Engine.load(tmp_path / "art", threads=1)
    ids = engine.encode("import os")
    cache = engine.backend.new_cache(1, 32)
    ours = engine.backend.prefill(cache, [0], [ids])[0]
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0, -1].numpy()
    assert np.abs(ours - want).max() < 1e-4


def test_gpt2_vocab_and_merges_tokenizer(store, tmp_path):
    """A GPT-2 dir with only vocab.json + merges.txt gets a tokenizer.json equal to transformers' GPT2Tokenizer."""
    import transformers
    from tokenizers import Tokenizer

    src = store.checkpoint("gpt2")
    ckpt = tmp_path / "gpt2"
    shutil.copytree(src, ckpt)
    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    model = json.loads(tok.to_str())["model"]
    (ckpt / "vocab.json").write_text(json.dumps(model["vocab"]))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    (ckpt / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    (ckpt / "tokenizer.json").unlink()
    (ckpt / "tokenizer_config.json").unlink()
    export_checkpoint(ckpt, tmp_path / "art")
    engine = Engine.load(tmp_path / "art", threads=1)
    slow = transformers.GPT2Tokenizer(str(ckpt / "vocab.json"), str(ckpt / "merges.txt"))
    for text in ["def f(x):\n    return x + 1", "import json, sys  # comment", "  spaced   out  "]:
        assert engine.tokenizer.encode(text) == slow.encode(text)
        assert engine.tokenizer.decode(engine.tokenizer.encode(text)) == text
