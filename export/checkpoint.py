"""Reading a local Hugging Face checkpoint directory: config and weights.

Weights come from ``*.safetensors`` (single or sharded with an index) or ``pytorch_model.bin``
(single or sharded). They are renamed into llmx's module names by one rule table per family
(``WEIGHT_RULES``). llmx's linear weights are [in, out]: HF Linear weights ([out, in]) are
transposed, GPT-2's Conv1D weights ([in, out]) are not; q/k/v and gate/up are concatenated
along the output axis so each becomes one matmul.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from llmx.errors import CheckpointError
from llmx.spec import ModelSpec, spec_from_hf_config

# (llmx name, HF names relative to a layer or the model, how to combine). "{i}" is the layer.
_LLAMA = {
    "prefixes": ("model.",),
    "model": [
        ("embed.weight", ["embed_tokens.weight"], "copy"),
        ("norm.weight", ["norm.weight"], "copy"),
    ],
    "head": ("lm_head.weight", ["lm_head.weight"], "transpose"),
    "layer": [
        ("attn_norm.weight", ["input_layernorm.weight"], "copy"),
        ("attn.qkv.weight", ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"], "concat_t"),
        ("attn.qkv.bias", ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"], "concat"),
        ("attn.o.weight", ["self_attn.o_proj.weight"], "transpose"),
        ("attn.o.bias", ["self_attn.o_proj.bias"], "copy"),
        ("mlp_norm.weight", ["post_attention_layernorm.weight"], "copy"),
        ("mlp.up.weight", ["mlp.gate_proj.weight", "mlp.up_proj.weight"], "concat_t"),
        ("mlp.up.bias", ["mlp.gate_proj.bias", "mlp.up_proj.bias"], "concat"),
        ("mlp.down.weight", ["mlp.down_proj.weight"], "transpose"),
        ("mlp.down.bias", ["mlp.down_proj.bias"], "copy"),
    ],
    "layer_prefix": "layers.{i}.",
}

# GPT-2 stores Conv1D weights as [in, out] already.
_GPT2 = {
    "prefixes": ("transformer.",),
    "model": [
        ("embed.weight", ["wte.weight"], "copy"),
        ("pos_embed.weight", ["wpe.weight"], "copy"),
        ("norm.weight", ["ln_f.weight"], "copy"),
        ("norm.bias", ["ln_f.bias"], "copy"),
    ],
    "head": ("lm_head.weight", ["lm_head.weight"], "transpose"),
    "layer": [
        ("attn_norm.weight", ["ln_1.weight"], "copy"),
        ("attn_norm.bias", ["ln_1.bias"], "copy"),
        ("attn.qkv.weight", ["attn.c_attn.weight"], "copy"),
        ("attn.qkv.bias", ["attn.c_attn.bias"], "copy"),
        ("attn.o.weight", ["attn.c_proj.weight"], "copy"),
        ("attn.o.bias", ["attn.c_proj.bias"], "copy"),
        ("mlp_norm.weight", ["ln_2.weight"], "copy"),
        ("mlp_norm.bias", ["ln_2.bias"], "copy"),
        ("mlp.up.weight", ["mlp.c_fc.weight"], "copy"),
        ("mlp.up.bias", ["mlp.c_fc.bias"], "copy"),
        ("mlp.down.weight", ["mlp.c_proj.weight"], "copy"),
        ("mlp.down.bias", ["mlp.c_proj.bias"], "copy"),
    ],
    "layer_prefix": "h.{i}.",
}

# BERT is post-norm: attn_norm/mlp_norm here are the LayerNorms *after* each residual add.
_BERT = {
    "prefixes": ("bert.", "model."),
    "model": [
        ("embed.weight", ["embeddings.word_embeddings.weight"], "copy"),
        ("pos_embed.weight", ["embeddings.position_embeddings.weight"], "copy"),
        ("type_embed.weight", ["embeddings.token_type_embeddings.weight"], "copy"),
        ("embed_norm.weight", ["embeddings.LayerNorm.weight"], "copy"),
        ("embed_norm.bias", ["embeddings.LayerNorm.bias"], "copy"),
    ],
    "head": None,
    "layer": [
        ("attn.qkv.weight", ["attention.self.query.weight", "attention.self.key.weight", "attention.self.value.weight"], "concat_t"),
        ("attn.qkv.bias", ["attention.self.query.bias", "attention.self.key.bias", "attention.self.value.bias"], "concat"),
        ("attn.o.weight", ["attention.output.dense.weight"], "transpose"),
        ("attn.o.bias", ["attention.output.dense.bias"], "copy"),
        ("attn_norm.weight", ["attention.output.LayerNorm.weight"], "copy"),
        ("attn_norm.bias", ["attention.output.LayerNorm.bias"], "copy"),
        ("mlp.up.weight", ["intermediate.dense.weight"], "transpose"),
        ("mlp.up.bias", ["intermediate.dense.bias"], "copy"),
        ("mlp.down.weight", ["output.dense.weight"], "transpose"),
        ("mlp.down.bias", ["output.dense.bias"], "copy"),
        ("mlp_norm.weight", ["output.LayerNorm.weight"], "copy"),
        ("mlp_norm.bias", ["output.LayerNorm.bias"], "copy"),
    ],
    "layer_prefix": "encoder.layer.{i}.",
}

WEIGHT_RULES = {"llama": _LLAMA, "mistral": _LLAMA, "qwen2": _LLAMA, "gpt2": _GPT2, "bert": _BERT}


@dataclass
class Checkpoint:
    path: Path
    config: dict
    spec: ModelSpec
    weight_files: list[Path]


def open_checkpoint(path: str | Path) -> Checkpoint:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    config_path = path / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{path} has no config.json; expected a Hugging Face checkpoint directory")
    try:
        config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{config_path} is not valid JSON: {exc}") from exc
    spec = spec_from_hf_config(config)
    return Checkpoint(path, config, spec, _weight_files(path))


def _weight_files(path: Path) -> list[Path]:
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = path / index_name
        if index.is_file():
            try:
                names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (json.JSONDecodeError, KeyError, UnicodeDecodeError) as exc:
                raise CheckpointError(f"{index} is malformed: {exc}") from exc
            missing = [n for n in names if not (path / n).is_file()]
            if missing:
                raise CheckpointError(f"{path} is missing weight shards listed in {index_name}: {', '.join(missing)}")
            return [path / n for n in names]
    for single in ("model.safetensors", "pytorch_model.bin"):
        if (path / single).is_file():
            return [path / single]
    raise CheckpointError(f"{path} has no weights (model.safetensors, pytorch_model.bin or a sharded index)")


def read_state_dict(files: list[Path]) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            if file.suffix == ".safetensors":
                tensors.update(load_file(str(file)))
            else:
                tensors.update(torch.load(file, map_location="cpu", weights_only=True))
        except Exception as exc:  # corrupt files raise many exception types
            raise CheckpointError(f"cannot read weights from {file.name}: {str(exc).splitlines()[0]}") from exc
    return tensors


def map_weights(spec: ModelSpec, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF tensor names -> llmx module names, as float32. Raises on missing tensors."""
    rules = WEIGHT_RULES[spec.family]
    hf = {_strip(name, rules["prefixes"]): t for name, t in hf.items()}

    def take(names: list[str], how: str, required: bool) -> torch.Tensor | None:
        present = [n for n in names if n in hf]
        if not present:
            if required:
                raise CheckpointError(f"weights are missing tensor {names[0]!r}")
            return None
        if len(present) != len(names):
            absent = sorted(set(names) - set(present))
            raise CheckpointError(f"weights are missing tensor {absent[0]!r}")
        parts = [hf[n].to(torch.float32) for n in names]
        if how in ("transpose", "concat_t"):
            parts = [p.t() for p in parts]
        return torch.cat(parts, dim=-1).contiguous() if len(parts) > 1 or parts[0].dim() == 1 else parts[0].contiguous()

    def required(ours: str) -> bool:
        if ours.endswith(".bias"):
            kind = "qkv" if ".qkv." in ours else "o" if ".o." in ours else "mlp" if ".mlp." in ours else "norm"
            return {"qkv": spec.qkv_bias, "o": spec.o_bias, "mlp": spec.mlp_bias}.get(kind, True)
        return True

    out: dict[str, torch.Tensor] = {}
    for ours, names, how in rules["model"]:
        if ours == "pos_embed.weight" and spec.position != "learned":
            continue
        if (t := take(names, how, required(ours))) is not None:
            out[ours] = t
    if spec.kind == "decoder" and spec.tie_word_embeddings:
        out["lm_head.weight"] = out["embed.weight"].t().contiguous()
    elif spec.kind == "decoder":
        ours, names, how = rules["head"]
        out[ours] = take(names, how, True)
    for i in range(spec.num_layers):
        layer = rules["layer_prefix"].format(i=i)
        for ours, names, how in rules["layer"]:
            full = f"layers.{i}.{ours}"
            if (t := take([layer + n for n in names], how, required(full))) is not None:
                out[full] = t
    return out


def _strip(name: str, prefixes: tuple[str, ...]) -> str:
    for prefix in prefixes:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def load_model(checkpoint: Checkpoint):
    """Build llmx's Decoder or Encoder for the checkpoint and load its weights (strictly)."""
    return build_model(checkpoint.spec, map_weights(checkpoint.spec, read_state_dict(checkpoint.weight_files)))


def build_model(spec: ModelSpec, weights: dict[str, torch.Tensor]):
    """llmx's Decoder or Encoder for ``spec`` holding ``weights`` (llmx names, checked strictly)."""
    if spec.kind == "encoder":
        from llmx.export.encoder import Encoder as model_class
    else:
        from llmx.export.modules import Decoder as model_class

    # Parameters are built on the meta device and replaced by the mapped tensors themselves
    # (assign=True): a materialized model would hold a second fp32 copy of every weight.
    with _parameters_on_meta():
        model = model_class(spec)
    expected = model.state_dict()
    for name, tensor in weights.items():
        if name in expected and tensor.shape != expected[name].shape:
            raise CheckpointError(
                f"tensor {name} has shape {tuple(tensor.shape)}, but config.json implies {tuple(expected[name].shape)}"
            )
    missing, unexpected = model.load_state_dict(weights, strict=False, assign=True)
    missing = [m for m in missing if m != "inv_freq"]
    if missing or unexpected:
        raise CheckpointError(f"weights do not match the config: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return model.eval()


@contextlib.contextmanager
def _parameters_on_meta():
    """Modules built inside get meta parameters; buffers (rotary tables) stay real.

    Accelerate's ``init_empty_weights`` does the same; ``torch.device("meta")`` would also
    move the buffers, which no checkpoint holds.
    """
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None:
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register
