"""Sentence-embedding encoders (BERT family) and their single ONNX graph.

    embed: input_ids, attention_mask, token_type_ids [B,S] -> embeddings [B,H]

Pooling (mean / CLS / max / mean-sqrt-len) and L2 normalization are inside the graph, read from
the checkpoint's sentence-transformers config (modules.json, 1_Pooling/config.json), so every
backend, including an engine on an edge box, returns the finished embedding.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from llmx.artifact.manifest import Manifest
from llmx.errors import CheckpointError
from llmx.export.manifest import FP32
from llmx.export.modules import MLP, Attention, make_norm
from llmx.export.tracing import strip_metadata, trace
from llmx.spec import ModelSpec

POOLING_MODES = ("mean", "cls", "max", "mean_sqrt_len")


def read_sentence_config(path: Path) -> dict:
    """Pooling, normalization and max input length from a sentence-transformers checkpoint."""
    modules_file = path / "modules.json"
    pooling, normalize, max_tokens = "mean", False, None
    if modules_file.is_file():
        modules = json.loads(modules_file.read_text())
        for module in modules:
            kind = module.get("type", "")
            if kind.endswith("Pooling"):
                cfg = json.loads((path / module["path"] / "config.json").read_text())
                chosen = [m for m in POOLING_MODES if cfg.get(f"pooling_mode_{m}_token" if m == "cls" else f"pooling_mode_{m}_tokens")]
                if len(chosen) != 1:
                    raise CheckpointError(f"pooling config {cfg} is not supported (exactly one of {POOLING_MODES})")
                pooling = chosen[0]
            elif kind.endswith("Normalize"):
                normalize = True
            elif not kind.endswith("Transformer"):
                raise CheckpointError(f"sentence-transformers module {kind!r} is not supported")
    st_config = path / "sentence_bert_config.json"
    if st_config.is_file():
        max_tokens = json.loads(st_config.read_text()).get("max_seq_length")
    return {"pooling": pooling, "normalize": normalize, "max_input_tokens": max_tokens}


class PostNormBlock(nn.Module):
    """BERT's block: attention and MLP each followed by residual add, then LayerNorm."""

    def __init__(self, spec: ModelSpec, layer: int):
        super().__init__()
        self.attn = Attention(spec, layer)
        self.attn_norm = make_norm(spec)
        self.mlp = MLP(spec)
        self.mlp_norm = make_norm(spec)

    def forward(self, x, allowed):
        q, k, v = self.attn.project(x, None)
        x = self.attn_norm(x + self.attn.attend(q, k, v, allowed))
        return self.mlp_norm(x + self.mlp(x))


class Encoder(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.embed = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.pos_embed = nn.Embedding(spec.max_position_embeddings, spec.hidden_size)
        self.type_embed = nn.Embedding(max(spec.type_vocab_size, 1), spec.hidden_size)
        self.embed_norm = make_norm(spec)
        self.layers = nn.ModuleList(PostNormBlock(spec, i) for i in range(spec.num_layers))

    def forward(self, input_ids, attention_mask, token_type_ids):
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        x = self.embed(input_ids) + self.pos_embed(positions) + self.type_embed(token_type_ids)
        x = self.embed_norm(x)
        valid = attention_mask.bool()
        allowed = valid[:, None, None, :]  # [B,1,1,S]: every query sees every real token
        for block in self.layers:
            x = block(x, allowed)
        return self.pool(x, attention_mask)

    def pool(self, x, attention_mask):
        mask = attention_mask.unsqueeze(-1).to(x.dtype)
        mode = self.spec.pooling
        if mode == "cls":
            out = x[:, 0]
        elif mode == "max":
            out = x.masked_fill(mask == 0, -1e9).max(dim=1).values
        else:
            total = (x * mask).sum(dim=1)
            count = mask.sum(dim=1).clamp(min=1e-9)
            out = total / (count.sqrt() if mode == "mean_sqrt_len" else count)
        return F.normalize(out, p=2, dim=-1) if self.spec.normalize else out


def export_encoder(model: Encoder, out_dir: Path) -> dict:
    from llmx.artifact.onnx_files import load_graph, save_graphs

    batch, seq = torch.export.Dim("batch"), torch.export.Dim("sequence")
    ids = torch.randint(0, model.spec.vocab_size, (2, 7))
    mask = torch.ones_like(ids)
    types = torch.zeros_like(ids)
    axes = {0: batch, 1: seq}
    with tempfile.TemporaryDirectory() as tmp:
        program = trace(model, (ids, mask, types), ["input_ids", "attention_mask", "token_type_ids"], ["embeddings"],
                        {"input_ids": axes, "attention_mask": axes, "token_type_ids": axes})
        program.save(str(Path(tmp) / "embed.onnx"), external_data=True)
        graph = load_graph(Path(tmp) / "embed.onnx")
        strip_metadata(graph)
        save_graphs({"embed": graph}, out_dir, sources={"embed": Path(tmp)})
    return {"embed": graph}


def encoder_manifest(model: Encoder, out_dir: Path, tokenizer: dict) -> Manifest:
    """Trace the embedding graph into ``out_dir``; the encoder artifact's manifest (no lineage yet)."""
    from llmx.artifact.onnx_files import describe_graph, load_graph

    export_encoder(model, out_dir)
    graphs = {"embed": describe_graph(load_graph(out_dir / "embed.onnx"), "embed.onnx")}
    return Manifest(kind="encoder", model=model.spec.to_dict(), graphs=graphs, tokenizer=tokenizer, precision=dict(FP32))
