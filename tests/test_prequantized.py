"""Pre-quantized checkpoints (GPTQ, AWQ, compressed-tensors pack-quantized) written from the tiny
Llama, each with its format's own packing code re-implemented here (the library and function are
named at each packer); export/prequantized.py reads them.

(1) The MatMulNBits blocks dequantize to exactly the values the format's own dequantizer gives
    (re-implemented here from the library's code, in float64: no rounding of its own).
(2) The artifact's logits (MatMulNBits at accuracy_level 0: float activations) equal transformers'
    Llama holding those dequantized weights to 1e-4 of the logit scale, far closer than the
    quantization error; a compressed-tensors checkpoint is also loaded by transformers itself (the
    ``compressed-tensors`` package, a test dependency, decompresses it on CPU). transformers loads
    GPTQ and AWQ only through gptqmodel (+ optimum for GPTQ), which the test install does not have:
    benchmarks/prequantized_parity.py checks against them, on checkpoints gptqmodel writes.
(3) GPTQ's act-order: groups permuted as whole blocks keep their blocks, scattered ones are
    sorted into blocks (x gathered to match); groups smaller than a block are refused for blocks
    in one line and read as floats. Unsupported methods are refused in one line.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from test_gguf import _exact_kernels, prefill_logits, prompt_ids, session  # noqa: E402

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
QKV = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
       "model.layers.0.self_attn.v_proj.weight"]

# name -> (method, options). The tiny Llama's inputs: 64 (q/k/v/o, gate/up), 96 (down).
VARIANTS = {
    "gptq": ("gptq", dict(bits=4, group_size=32, sym=True, checkpoint_format="gptq")),
    "gptq-asym": ("gptq", dict(bits=4, group_size=32, sym=False, checkpoint_format="gptq")),
    # + the head quantized too (GPTQ's lm_head option)
    "gptq-v2-8bit-asym-channel": ("gptq", dict(bits=8, group_size=-1, sym=False, checkpoint_format="gptq_v2", lm_head=True)),
    "awq": ("awq", dict(bits=4, group_size=32)),
    "ct-w4a16": ("compressed-tensors", dict(bits=4, group_size=32, sym=True)),
    "ct-w8a16-asym": ("compressed-tensors", dict(bits=8, group_size=32, sym=False)),
    "ct-w4a16-asym-channel": ("compressed-tensors", dict(bits=4, group_size=-1, sym=False)),
}


# ---- quantizing (round to nearest; the layouts below are what matters) ------------------------

def quantize(w: np.ndarray, bits: int, g_idx: np.ndarray, groups: int, sym: bool, scale_dtype=torch.float16):
    """w [N, K] -> unsigned codes [N, K], scales [N, G] (the stored dtype, as float32), zeros [N, G]:
    w ~ (codes - zeros[:, g_idx]) * scales[:, g_idx]. GPTQ's Quantizer.find_params rule: symmetric
    zero 2^(bits-1), scale 2 max|w| / maxq; asymmetric scale (max - min) / maxq, zero round(-min / scale)."""
    maxq = (1 << bits) - 1
    n = w.shape[0]
    lo, hi = np.zeros((n, groups)), np.zeros((n, groups))
    for g in range(groups):
        cols = w[:, g_idx == g]
        lo[:, g], hi[:, g] = np.minimum(cols.min(1), 0), np.maximum(cols.max(1), 0)
    if sym:
        scale = 2 * np.maximum(-lo, hi) / maxq
    else:
        scale = (hi - lo) / maxq
    scale = torch.from_numpy(np.where(scale == 0, 1.0, scale)).to(scale_dtype).to(torch.float32).numpy()
    zeros = np.full((n, groups), (maxq + 1) // 2) if sym else np.clip(np.round(-lo / scale), 0, maxq)
    codes = np.clip(np.round(w / scale[:, g_idx]) + zeros[:, g_idx], 0, maxq)
    return codes.astype(np.int64), scale.astype(np.float32), zeros.astype(np.int64)


# ---- packers, after each library's own ------------------------------------------------------

def pack_gptq(prefix: str, w: np.ndarray, bits: int, group_size: int, sym: bool, checkpoint_format: str,
              g_idx: np.ndarray | None = None) -> dict[str, torch.Tensor]:
    """gptqmodel 7.7 nn_modules/qlinear/__init__.py ``pack_original`` (qweight: rows of K, field j of
    word r = input r * 32/bits + j; qzeros: columns of N) then, for v1, utils/model.py
    ``convert_gptq_v2_to_v1_format_module`` (the packed words minus 0x11111111 / 0x01010101)."""
    n, k = w.shape
    if g_idx is None:
        g_idx = np.arange(k) // (group_size if group_size > 0 else k)
    groups = int(g_idx.max()) + 1
    codes, scales, zeros = quantize(w, bits, g_idx, groups, sym)
    pf = 32 // bits
    int_weight = codes.T  # [K, N]
    qweight = np.zeros((math.ceil(k * bits / 32), n), np.int64)
    for row in range(qweight.shape[0]):
        for j in range(min(pf, k - row * pf)):
            qweight[row] |= int_weight[row * pf + j] << (bits * j)
    zeros_gn = zeros.T  # [G, N]
    qzeros = np.zeros((groups, math.ceil(n * bits / 32)), np.int64)
    for col in range(qzeros.shape[1]):
        for j in range(min(pf, n - col * pf)):
            qzeros[:, col] |= zeros_gn[:, col * pf + j] << (bits * j)
    qzeros = qzeros.astype(np.uint32).view(np.int32)
    if checkpoint_format == "gptq":
        qzeros = (torch.from_numpy(qzeros) - (0b00010001000100010001000100010001 if bits == 4
                                              else 0b00000001000000010000000100000001)).numpy()
    return {prefix + ".qweight": torch.from_numpy(qweight.astype(np.uint32).view(np.int32)),
            prefix + ".qzeros": torch.from_numpy(np.ascontiguousarray(qzeros)),
            prefix + ".scales": torch.from_numpy(np.ascontiguousarray(scales.T)).to(torch.float16),
            prefix + ".g_idx": torch.from_numpy(g_idx.astype(np.int32))}


AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]


def pack_awq(prefix: str, w: np.ndarray, bits: int, group_size: int) -> dict[str, torch.Tensor]:
    """AutoAWQ 0.2.9 awq/modules/linear/gemm.py ``WQLinear_GEMM.from_linear``: intweight [K, N],
    qweight[:, col] |= intweight[:, col * 8 + order_map[i]] << 4 i; qzeros the same from zeros [G, N];
    scales [G, N] fp16 (AWQ's zero points are asymmetric min-max ones)."""
    n, k = w.shape
    g_idx = np.arange(k) // group_size
    codes, scales, zeros = quantize(w, bits, g_idx, k // group_size, sym=False)

    def pack(values):  # [R, N] -> [R, N / 8]
        out = np.zeros((values.shape[0], values.shape[1] // 8), np.int64)
        for col in range(out.shape[1]):
            for i in range(8):
                out[:, col] |= values[:, col * 8 + AWQ_ORDER[i]] << (i * 4)
        return torch.from_numpy(out.astype(np.uint32).view(np.int32))

    return {prefix + ".qweight": pack(codes.T), prefix + ".qzeros": pack(zeros.T),
            prefix + ".scales": torch.from_numpy(np.ascontiguousarray(scales.T)).to(torch.float16)}


def pack_to_int32(value: np.ndarray, num_bits: int, packed_dim: int = 1) -> np.ndarray:
    """compressed-tensors 0.20 compressors/pack_quantized/helpers.py ``pack_to_int32``: signed int8
    values + 2^(bits-1), element i of a row at bit i * bits of its words (dense, little-endian)."""
    value = value.astype(np.int64) + (1 << (num_bits - 1))
    if packed_dim == 0:
        value = value.T
    rows, cols = value.shape
    words = np.zeros((rows, math.ceil(cols * num_bits / 32)), np.int64)
    for i in range(cols):
        start = i * num_bits
        words[:, start // 32] |= (value[:, i] << (start % 32)) & 0xFFFFFFFF
        if start % 32 + num_bits > 32:
            words[:, start // 32 + 1] |= value[:, i] >> (32 - start % 32)
    words = words.astype(np.uint32).view(np.int32)
    return np.ascontiguousarray(words.T if packed_dim == 0 else words)


def pack_compressed(prefix: str, w: np.ndarray, bits: int, group_size: int, sym: bool,
                    scale_dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    """compressed-tensors ``PackedQuantizationCompressor.compress``: weight_packed = pack_to_int32(q),
    weight_scale [N, G], weight_shape, asymmetric zero points pack_to_int32(zp, packed_dim=0); the
    quantized values signed (q_min -2^(bits-1))."""
    n, k = w.shape
    group_size = group_size if group_size > 0 else k  # "channel": one scale per output, [N, 1]
    g_idx = np.arange(k) // group_size
    codes, scales, zeros = quantize(w, bits, g_idx, k // group_size, sym, scale_dtype)
    offset = 1 << (bits - 1)
    out = {prefix + ".weight_packed": torch.from_numpy(pack_to_int32(codes - offset, bits)),
           prefix + ".weight_scale": torch.from_numpy(scales).to(scale_dtype),
           prefix + ".weight_shape": torch.tensor([n, k])}
    if not sym:
        out[prefix + ".weight_zero_point"] = torch.from_numpy(pack_to_int32(zeros - offset, bits, packed_dim=0))
    return out


def quantization_config(method: str, options: dict) -> dict:
    if method == "gptq":
        return {"quant_method": "gptq", "bits": options["bits"], "group_size": options["group_size"],
                "desc_act": options.get("desc_act", False), "sym": options["sym"], "true_sequential": True,
                "checkpoint_format": options["checkpoint_format"], "damp_percent": 0.01, "static_groups": False,
                "lm_head": options.get("lm_head", False)}
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": options["group_size"], "zero_point": True,
                "version": "gemm", "modules_to_not_convert": None}
    channel = options["group_size"] <= 0
    weights = {"num_bits": options["bits"], "type": "int", "symmetric": options["sym"],
               "strategy": "channel" if channel else "group", "group_size": None if channel else options["group_size"],
               "dynamic": False, "actorder": None, "observer": "minmax",
               "observer_kwargs": {}, "block_structure": None}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None, "format": "pack-quantized"}},
            "ignore": ["lm_head"], "kv_cache_scheme": None, "global_compression_ratio": None,
            "sparsity_config": {}}


def write_prequantized(src: Path, dst: Path, method: str, options: dict) -> Path:
    """The checkpoint at ``src`` with every layer linear quantized in ``method``'s layout (embeddings,
    norms and the head stay as they are, as these tools leave them)."""
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True)
    for file in src.iterdir():
        if file.suffix != ".safetensors":
            shutil.copy(file, dst / file.name)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config(method, options)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    head = options.get("lm_head", False)
    options = {key: value for key, value in options.items() if key not in ("desc_act", "lm_head")}
    out = {}
    for name, tensor in load_file(str(src / "model.safetensors")).items():
        prefix = name.removesuffix(".weight")
        if not (name.endswith(".weight") and (prefix.split(".", 3)[-1] in LINEARS or head and prefix == "lm_head")):
            out[name] = tensor
            continue
        w = tensor.to(torch.float32).numpy()
        if method == "gptq":
            out.update(pack_gptq(prefix, w, **options))
        elif method == "awq":
            out.update(pack_awq(prefix, w, **options))
        else:
            out.update(pack_compressed(prefix, w, **options))
    save_file(out, str(dst / "model.safetensors"))
    return dst


# ---- reference dequantizers, after each library's own ---------------------------------------

def dequantize_gptq(t: dict, prefix: str, bits: int, checkpoint_format: str) -> np.ndarray:
    """gptqmodel ``dequantize_weight`` (wf shifts; v1 zero points corrected first by
    ``convert_gptq_v1_to_v2_format_module``'s word-wise add): scales[g_idx] * (weight - zeros[g_idx]), [N, K]."""
    qweight, qzeros = t[prefix + ".qweight"].to(torch.int64) & 0xFFFFFFFF, t[prefix + ".qzeros"].to(torch.int64)
    if checkpoint_format == "gptq":
        qzeros = qzeros + (0b00010001000100010001000100010001 if bits == 4 else 0b00000001000000010000000100000001)
    qzeros &= 0xFFFFFFFF
    scales, g_idx = t[prefix + ".scales"].to(torch.float64), t[prefix + ".g_idx"].long()
    wf = torch.tensor(list(range(0, 32, bits)), dtype=torch.int64).unsqueeze(0)
    maxq = (1 << bits) - 1
    zeros = torch.bitwise_right_shift(qzeros.unsqueeze(2).expand(-1, -1, 32 // bits), wf.unsqueeze(0)) & maxq
    zeros = zeros.reshape(scales.shape)
    weight = torch.bitwise_right_shift(qweight.unsqueeze(1).expand(-1, 32 // bits, -1), wf.unsqueeze(-1)) & maxq
    weight = weight.reshape(weight.shape[0] * weight.shape[1], weight.shape[2])
    return (scales[g_idx] * (weight - zeros[g_idx]).to(torch.float64)).T.numpy()


def dequantize_awq(t: dict, prefix: str, group_size: int) -> np.ndarray:
    """AutoAWQ awq/utils/packing_utils.py ``dequantize_gemm`` (unpack_awq, reverse_awq_order), in float64."""
    shifts = torch.arange(0, 32, 4)

    def unpack(q):
        q = torch.bitwise_right_shift(q.to(torch.int64)[:, :, None], shifts[None, None, :]).reshape(q.shape[0], -1)
        order = torch.arange(q.shape[-1]).view(-1, 8)[:, AWQ_REVERSE_ORDER].view(-1)
        return (q[:, order] & 15).to(torch.float64)

    iweight, izeros = unpack(t[prefix + ".qweight"]), unpack(t[prefix + ".qzeros"])
    scales = t[prefix + ".scales"].to(torch.float64).repeat_interleave(group_size, dim=0)
    return ((iweight - izeros.repeat_interleave(group_size, dim=0)) * scales).T.numpy()


def unpack_from_int32(value: torch.Tensor, num_bits: int, cols: int, packed_dim: int = 1) -> torch.Tensor:
    """compressed-tensors ``unpack_from_int32`` (the general path: element i from bit i * bits), signed."""
    if packed_dim == 0:
        value = value.T
    words = value.to(torch.int64) & 0xFFFFFFFF
    out = torch.zeros(words.shape[0], cols, dtype=torch.int64)
    for i in range(cols):
        start = i * num_bits
        lo = words[:, start // 32] >> (start % 32)
        if start % 32 + num_bits > 32:
            lo |= words[:, start // 32 + 1] << (32 - start % 32)
        out[:, i] = lo & ((1 << num_bits) - 1)
    out -= 1 << (num_bits - 1)
    return out.T if packed_dim == 0 else out


def dequantize_compressed(t: dict, prefix: str, bits: int, group_size: int) -> np.ndarray:
    """compressed-tensors ``PackedQuantizationCompressor.decompress`` + ``_dequantize``: (x_q - zp) * scale per group."""
    n, k = t[prefix + ".weight_shape"].tolist()
    q = unpack_from_int32(t[prefix + ".weight_packed"], bits, k).to(torch.float64)
    scale = t[prefix + ".weight_scale"].to(torch.float64)
    zp = torch.zeros_like(scale)
    if prefix + ".weight_zero_point" in t:
        zp = unpack_from_int32(t[prefix + ".weight_zero_point"], bits, n, packed_dim=0).to(torch.float64)
    g = torch.arange(k) // (group_size if group_size > 0 else k)
    return ((q - zp[:, g]) * scale[:, g]).numpy()


def reference_weights(path: Path, method: str, options: dict) -> dict[str, np.ndarray]:
    """Every layer linear's float64 [out, in] values, dequantized as the format's library does."""
    from safetensors.torch import load_file

    t = load_file(str(path / "model.safetensors"))
    out = {}
    for name in t:
        for suffix in (".qweight", ".weight_packed"):
            if name.endswith(suffix):
                prefix = name.removesuffix(suffix)
                if method == "gptq":
                    w = dequantize_gptq(t, prefix, options["bits"], options["checkpoint_format"])
                elif method == "awq":
                    w = dequantize_awq(t, prefix, options["group_size"])
                else:
                    w = dequantize_compressed(t, prefix, options["bits"], options["group_size"])
                out[prefix + ".weight"] = w
    return out


# ---- fixtures --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def prequantized(store, tmp_path_factory):
    """variant -> (checkpoint, artifact): written and exported (fused, its own blocks) once per module."""
    from llmx.export import export_checkpoint

    root, made = tmp_path_factory.mktemp("prequantized"), {}

    def get(variant: str) -> tuple[Path, Path]:
        if variant not in made:
            method, options = VARIANTS[variant]
            path = write_prequantized(store.checkpoint("llama"), root / variant, method, options)
            export_checkpoint(path, root / f"art-{variant}", graphs="fused")
            made[variant] = path, root / f"art-{variant}"
        return made[variant]

    return get


def _transformers_logits(checkpoint: Path, ids: list[int], weights: dict[str, np.ndarray] | None = None) -> np.ndarray:
    """transformers' Llama of ``checkpoint`` (the original, unquantized one), with ``weights`` in place."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    if weights:
        state = model.state_dict()
        for name, w in weights.items():
            assert state[name].shape == w.shape, name
            state[name] = torch.from_numpy(w.astype(np.float32))
        model.load_state_dict(state, strict=True)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].numpy()


# ---- (1) exactly the format's values ---------------------------------------------------------

@pytest.mark.parametrize("variant", list(VARIANTS))
def test_blocks_hold_exactly_the_formats_dequantized_values(variant, store, tmp_path):
    from llmx.export.checkpoint import open_checkpoint
    from llmx.export.prequantized import prequantized_checkpoint
    from llmx.export.gguf_blocks import dequantize
    from llmx.export.prequantized import prequantized_record
    from llmx.quant_blocks import Blocks

    method, options = VARIANTS[variant]
    path = write_prequantized(store.checkpoint("llama"), tmp_path / "q", method, options)
    reference = reference_weights(path, method, options)
    assert len(reference) == 7 * 2 + options.get("lm_head", False)
    checkpoint = prequantized_checkpoint(open_checkpoint(path))
    reader = checkpoint.reader
    # The reader offers each quantized linear as its float .weight, and none of its packed tensors.
    assert sorted(n for n in reader if n.endswith("_proj.weight") or n in reference) == sorted(reference)
    assert not [n for n in reader if n.endswith((".qweight", ".qzeros", ".scales", ".g_idx", ".weight_packed",
                                                 ".weight_scale", ".weight_zero_point", ".weight_shape"))]
    for name, w in reference.items():
        values = reader[name]
        assert values.dtype == torch.float32
        np.testing.assert_array_equal(values.numpy().astype(np.float64), w, err_msg=name)  # exact in float32

    group = options["group_size"] if options["group_size"] > 0 else 128
    for names in (QKV, ["model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight"],
                  ["model.layers.1.mlp.down_proj.weight"]):
        blocks = checkpoint.stored_blocks(names)
        assert isinstance(blocks, Blocks) and blocks.bits == options["bits"]
        k = reference[names[0]].shape[1]
        assert blocks.block_size == max(b for b in (16, 32, 64, 128) if k % b == 0 and b <= group)
        np.testing.assert_array_equal(dequantize(blocks), np.concatenate([reference[n] for n in names]))
        if options.get("sym", False):  # the kernel's default zero point: no zero-point input
            assert blocks.zero_points is None
        else:
            assert blocks.zero_points is not None and blocks.zero_points.dtype == np.uint8
    assert checkpoint.stored_blocks(["model.embed_tokens.weight"]) is None  # stored as floats: read as floats
    assert prequantized_record(checkpoint)["kept_in_their_blocks"] == 6


# ---- (2) the artifact's logits ---------------------------------------------------------------

@pytest.mark.parametrize("variant", ["gptq", "gptq-asym", "gptq-v2-8bit-asym-channel", "awq", "ct-w4a16",
                                     "ct-w8a16-asym", "ct-w4a16-asym-channel"])
def test_artifact_matches_transformers_with_the_dequantized_weights(variant, prequantized, store):
    from llmx.artifact.manifest import load_manifest

    method, options = VARIANTS[variant]
    path, artifact = prequantized(variant)
    manifest = load_manifest(artifact)
    model, nbits = _exact_kernels(artifact)
    # qkv, o, gate|up, down per layer (and the head where it is quantized); the embedding stays float
    assert len(nbits) == 4 * manifest.model.num_layers + options.get("lm_head", False)
    assert {a.i for n in nbits for a in n.attribute if a.name == "bits"} == {options["bits"]}
    assert manifest.precision.scheme == ("w4" if options["bits"] == 4 else "w8")

    ids = prompt_ids(artifact)
    ours = prefill_logits(session(artifact, model=model), ids)
    reference = _transformers_logits(store.checkpoint("llama"), ids, reference_weights(path, method, options))
    original = _transformers_logits(store.checkpoint("llama"), ids)
    scale = max(1.0, np.abs(reference).max())
    kernel_rounding = np.abs(ours - reference).max()
    assert kernel_rounding <= 1e-4 * scale
    assert np.abs(reference - original).max() > 100 * kernel_rounding  # the comparison can tell them apart


def test_compressed_tensors_checkpoint_as_transformers_loads_it(prequantized):
    """transformers' own loading: the compressed-tensors package (a test dependency) decompresses on CPU.
    (Only the symmetric one: transformers 5.23 with compressed-tensors 0.20 refuses asymmetric
    pack-quantized checkpoints, their zero points being packed in the file but not in the
    modules it makes to load them.)"""
    import compressed_tensors  # noqa: F401 -- a test dependency: a broken install fails, it never skips
    import transformers

    path, artifact = prequantized("ct-w4a16")
    model, _ = _exact_kernels(artifact)
    ids = prompt_ids(artifact)
    ours = prefill_logits(session(artifact, model=model), ids)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        reference = theirs(torch.tensor([ids])).logits[0, -1].numpy()
    assert np.abs(ours - reference).max() <= 1e-4 * max(1.0, np.abs(reference).max())


def test_fp32_export_dequantizes_exactly(prequantized, store, tmp_path):
    """--precision fp32 (here: the reader without blocks) is the same model in float MatMuls."""
    from llmx.export.checkpoint import open_checkpoint
    from llmx.export.prequantized import prequantized_checkpoint
    from llmx.export.fused import export_fused
    from llmx.export.tokenizer import package_tokenizer

    path, artifact = prequantized("awq")
    checkpoint = prequantized_checkpoint(open_checkpoint(path))
    checkpoint.stored_blocks = None
    (tmp_path / "fp32").mkdir()
    tokenizer = package_tokenizer(checkpoint.path, tmp_path / "fp32", checkpoint.config)
    export_fused(checkpoint, tmp_path / "fp32", tokenizer, all_logits=False, precision="fp32", block_size=32,
                 log=lambda _: None)
    model, _ = _exact_kernels(artifact)
    ids = prompt_ids(artifact)
    ours = prefill_logits(session(artifact, model=model), ids)
    fp32 = prefill_logits(session(tmp_path / "fp32"), ids)
    assert np.abs(ours - fp32).max() <= 1e-4 * max(1.0, np.abs(fp32).max())


def test_gptq_v1_zero_points_are_restored_word_wise_as_gptqmodel_loads_them():
    """An asymmetric group whose zero point is 0 is stored as -1: the word-wise subtraction borrows
    from the next field (and out of the word's top one); gptqmodel's loader adds the constant back
    to the whole word, which a per-field "+1" would not undo."""
    from llmx.export.prequantized import _GPTQ

    rng = np.random.default_rng(1)
    w = rng.standard_normal((16, 64)).astype(np.float32)
    for row in (0, 7, 8):  # all positive: zero point 0 (7: a word's top field; 8: the next word's first)
        w[row, :32] = np.abs(w[row, :32]) + 0.1
    w[1, 32:] = -np.abs(w[1, 32:]) - 0.1  # all negative: zero point 15
    tensors = pack_gptq("l", w, 4, 32, sym=False, checkpoint_format="gptq")
    _, _, zeros = quantize(w, 4, np.arange(64) // 32, 2, sym=False)
    assert zeros[0, 0] == zeros[7, 0] == zeros[8, 0] == 0 and zeros[1, 1] == 15
    linear = _GPTQ({"bits": 4, "group_size": 32, "sym": False, "checkpoint_format": "gptq"}).decode(tensors, "l")
    np.testing.assert_array_equal(linear.zeros, zeros)
    np.testing.assert_array_equal(linear.dequantized().astype(np.float64), dequantize_gptq(tensors, "l", 4, "gptq"))


# ---- desc_act -------------------------------------------------------------------------------

def test_gptq_act_order_groups_whole_blocks_keep_their_blocks(store, tmp_path):
    """desc_act whose groups are whole runs of 32 inputs, permuted: a g_idx that is not k // 32, still blocks."""
    from llmx.export.checkpoint import open_checkpoint
    from llmx.export.prequantized import prequantized_checkpoint
    from llmx.export.gguf_blocks import dequantize

    options = dict(bits=4, group_size=32, sym=True, checkpoint_format="gptq", desc_act=True)
    g_idx = np.array([1, 0])[np.arange(64) // 32]  # q/k/v's 64 inputs: the second run is group 0
    path = _with_g_idx(write_prequantized(store.checkpoint("llama"), tmp_path / "q", "gptq", options),
                       store.checkpoint("llama"), QKV, g_idx)
    reference = reference_weights(path, "gptq", options)
    blocks = prequantized_checkpoint(open_checkpoint(path)).stored_blocks(QKV)
    assert blocks.block_size == 32
    np.testing.assert_array_equal(dequantize(blocks), np.concatenate([reference[n] for n in QKV]))


def _with_g_idx(path: Path, original: Path, names: list[str], g_idx: np.ndarray) -> Path:
    """``path``'s GPTQ linears ``names`` quantized again from ``original`` with groups ``g_idx``."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    weights = load_file(str(original / "model.safetensors"))
    for name in names:
        tensors.update(pack_gptq(name.removesuffix(".weight"), weights[name].numpy(), 4, 32, True, "gptq", g_idx=g_idx))
    save_file(tensors, str(path / "model.safetensors"))
    return path


def test_gptq_act_order_scattered_groups_are_sorted_into_blocks_and_x_gathered_to_match(store, tmp_path):
    """act-order proper: q's two groups of 32 are scattered over its 64 inputs (k and v in order).
    Sorted by group they are whole blocks; the graph gathers x in that order before q's
    MatMulNBits: the blocks hold the format's values, and the logits are transformers' with them."""
    from llmx.export import export_checkpoint
    from llmx.export.checkpoint import open_checkpoint
    from llmx.export.gguf_blocks import dequantize
    from llmx.export.prequantized import prequantized_checkpoint
    from llmx.quant_blocks import StackedBlocks

    options = dict(bits=4, group_size=32, sym=True, checkpoint_format="gptq", desc_act=True)
    g_idx = np.argsort(np.random.default_rng(0).permutation(64)) // 32  # act-order: each group's inputs scattered
    path = _with_g_idx(write_prequantized(store.checkpoint("llama"), tmp_path / "q", "gptq", options),
                       store.checkpoint("llama"), [QKV[0]], g_idx)
    reference = reference_weights(path, "gptq", options)
    blocks = prequantized_checkpoint(open_checkpoint(path)).stored_blocks(QKV)
    assert isinstance(blocks, StackedBlocks) and [p.input_order is not None for p in blocks.parts] == [True, False]
    q = blocks.parts[0]
    assert q.block_size == 32 and sorted(q.input_order) == list(range(64))
    np.testing.assert_array_equal(dequantize(q)[:, np.argsort(q.input_order)], reference[QKV[0]])

    artifact = tmp_path / "art"
    export_checkpoint(path, artifact, graphs="fused")
    model, _ = _exact_kernels(artifact)
    assert sum(n.op_type == "Gather" and n.name.endswith("_input_order") for n in model.graph.node) == 1
    ids = prompt_ids(artifact)
    ours = prefill_logits(session(artifact, model=model), ids)
    expected = _transformers_logits(store.checkpoint("llama"), ids, reference)
    assert np.abs(ours - expected).max() <= 1e-4 * max(1.0, np.abs(expected).max())


def test_gptq_groups_smaller_than_a_block_are_refused_for_blocks_and_read_as_floats(store, tmp_path):
    """Groups of 8 inputs, scattered: no sorting makes them MatMulNBits blocks (16 at least)."""
    from llmx.errors import CheckpointError
    from llmx.export import export_checkpoint
    from llmx.export.checkpoint import open_checkpoint
    from llmx.export.prequantized import prequantized_checkpoint

    options = dict(bits=4, group_size=32, sym=True, checkpoint_format="gptq", desc_act=True)
    name = QKV[0]
    g_idx = np.argsort(np.random.default_rng(0).permutation(64)) // 8
    path = _with_g_idx(write_prequantized(store.checkpoint("llama"), tmp_path / "q", "gptq", options),
                       store.checkpoint("llama"), [name], g_idx)
    checkpoint = prequantized_checkpoint(open_checkpoint(path))
    with pytest.raises(CheckpointError) as error:
        checkpoint.stored_blocks(QKV)
    message = str(error.value)
    assert "\n" not in message and name in message and "g_idx" in message and "--precision fp32" in message
    with pytest.raises(CheckpointError, match="g_idx"):
        export_checkpoint(path, tmp_path / "art", graphs="fused")
    assert not (tmp_path / "art").exists()
    # Read as floats (--precision fp32, portable, --verify): exactly the format's values.
    reference = reference_weights(path, "gptq", options)
    np.testing.assert_array_equal(checkpoint.reader[name].numpy().astype(np.float64), reference[name])


# ---- (3) refusals ----------------------------------------------------------------------------

@pytest.mark.parametrize("config,expected", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes'"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "quant_method 'fp8'"),
    ({"quant_method": "hqq"}, "quant_method 'hqq'"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "3-bit"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "'marlin'"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "'gemv'"),
    ({**quantization_config("compressed-tensors", dict(bits=4, group_size=32, sym=True)), "format": "float-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float", "strategy": "tensor"},
                              "format": "float-quantized"}}}, "'float-quantized'"),
])
def test_unsupported_quantization_is_refused_in_one_line(config, expected, store, tmp_path):
    from llmx.errors import CheckpointError
    from llmx.export.checkpoint import open_checkpoint
    from llmx.export.prequantized import prequantized_checkpoint

    path = tmp_path / "q"
    shutil.copytree(store.checkpoint("llama"), path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "quantization_config": config}))
    with pytest.raises(CheckpointError) as error:
        prequantized_checkpoint(open_checkpoint(path))
    message = str(error.value)
    assert expected in message and "\n" not in message
    if "quant_method '" in expected:
        assert "supported pre-quantized checkpoints: GPTQ" in message


def test_cli_refuses_an_unsupported_method_in_one_error_line(store, tmp_path, capsys):
    from test_cli import error_line, run

    path = tmp_path / "q"
    shutil.copytree(store.checkpoint("llama"), path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "bitsandbytes"}}))
    code, _, err = run(["export", str(path), "-o", str(tmp_path / "out")], capsys)
    assert code != 0
    line = error_line(err)
    assert "quant_method 'bitsandbytes'" in line and "GPTQ" in line and "AWQ" in line and "compressed-tensors" in line
    assert not (tmp_path / "out").exists()


def test_export_options_keep_or_dequantize_and_refuse_a_second_rounding(prequantized):
    from llmx.errors import InputError
    from llmx.export.checkpoint import open_checkpoint
    from llmx.export.prequantized import prequantized_checkpoint
    from llmx.export.prequantized import prequantized_export_options

    path, _ = prequantized("gptq")

    def options(graphs, precision, verify=False):
        checkpoint = prequantized_checkpoint(open_checkpoint(path))
        return (*prequantized_export_options(checkpoint, graphs, precision, verify), checkpoint.stored_blocks is not None)

    assert options(None, None) == ("fused", "gptq", True)  # as a quantized GGUF: its own blocks
    assert options("fused", None) == ("fused", "gptq", True)
    assert options("portable", None) == ("portable", "fp32", False)
    assert options(None, None, verify=True) == ("portable", "fp32", False)
    assert options("fused", "fp32") == ("fused", "fp32", False)  # dequantized, float MatMuls
    assert options(None, "fp16") == ("portable", "fp16", False)
    with pytest.raises(InputError, match="already quantized .gptq 4-bit, group 32, symmetric.; quantizing it again "
                                         "to w4 would round twice"):
        options("fused", "w4")
