"""INT8 KV cache: keys and values stored as int8 with static per-channel scales (a graph rewrite).

    prefill: present k/v  -> q = int8(clip(round(x / s), -127, 127))              -> present int8
    decode:  new k/v      -> q (as above) -> ScatterElements into past int8, in place -> present int8
             present[:, :, :L] -> float(q) * s                                     -> attention

``s[layer, k|v, kv_head, channel] = absmax / 127`` over the calibration windows' keys and
values (keys after RoPE, as they are cached). Keys carry RoPE: channels d and d + D/2 rotate
into each other with position, so each pair shares its larger scale and positions beyond the
calibration windows stay in range. The scales are constants in both graphs; the cache the
runtime allocates, binds, moves, forks and prefix-caches is simply an int8 buffer
(``kv.dtype``), so no runtime code knows about quantization, and memory is a quarter of fp32
(half of fp16).

Why static per-channel scales rather than dynamic per-token ones: a per-token scheme needs a
scale tensor beside every KV buffer, which every backend would then allocate, bind and copy;
static scales need none. Keys have outlier *channels* (KIVI, Liu et al. 2024), which a
per-channel scale absorbs and a per-token one does not. Attention inside the prefill graph
still uses the unquantized keys of the prompt; everything read from the cache is dequantized.
The exported (portable) decode graph updates the cache with ScatterElements, rewritten as above.
A fused decode graph's GroupQueryAttention (``llmx optimize``) takes the int8 cache itself: the
same scales as its per-channel ``k_scale``/``v_scale``, and it quantizes the new keys/values and
dequantizes inside its kernel. The prefill graphs of both are rewritten alike (a fused prefill's
GroupQueryAttention has no past, so it cannot write an int8 present itself).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from llmx.artifact.handle import Artifact
from llmx.artifact.manifest import Manifest
from llmx.artifact.onnx_files import describe_graph, load_graph, save_graphs
from llmx.artifact.staging import copy_tokenizer, finish, staged_artifact
from llmx.errors import ArtifactError, InputError
from llmx.runtime.engine import make_backend

QMAX = 127.0
_MIN_ABSMAX = 1e-6  # a channel that is always 0 still gets a finite scale


def kv_absmax(backend, windows: list[list[int]], rows: int = 4, progress=lambda n: None) -> list[np.ndarray]:
    """Largest |value| per (kv head, channel) of every cache buffer over ``windows``: [Hkv, D] each."""
    found = None
    for start in range(0, len(windows), rows):
        batch = windows[start : start + rows]
        cache = backend.new_cache(len(batch), max(len(w) for w in batch))
        backend.prefill(cache, list(range(len(batch))), batch)
        lengths = [len(w) for w in batch]
        for b, buf in enumerate(cache.buffers):
            seen = np.max([np.abs(buf[r, :, :n]).max(axis=1) for r, n in enumerate(lengths)], axis=0)
            if found is None:
                found = [np.zeros_like(seen) for _ in cache.buffers]
            found[b] = np.maximum(found[b], seen)
        progress(len(batch))
    if found is None:
        raise InputError("INT8 KV calibration needs at least one window of text")
    return found


def kv_scales(absmax: list[np.ndarray], rope: bool) -> list[np.ndarray]:
    """Scales [Hkv, D] per buffer (layer-major, key then value); RoPE pairs share the key scale."""
    scales = []
    for b, m in enumerate(absmax):
        m = np.maximum(m.astype(np.float32), _MIN_ABSMAX)
        if rope and b % 2 == 0:
            half = m.shape[-1] // 2
            pair = np.maximum(m[:, :half], m[:, half:])
            m = np.concatenate([pair, pair], axis=-1)
        scales.append(m / QMAX)
    return scales


class _Rewriter:
    """Adds nodes and constants to one graph under unique names."""

    def __init__(self, model):
        import onnx

        self.onnx, self.graph, self.nodes = onnx, model.graph, []

    def constant(self, name: str, value: np.ndarray) -> str:
        self.graph.initializer.append(self.onnx.numpy_helper.from_array(value, name))
        return name

    def node(self, op: str, inputs: list[str], output: str, **attrs) -> str:
        self.nodes.append(self.onnx.helper.make_node(op, inputs, [output], name=f"{output}_{op}", **attrs))
        return output

    def quantize(self, x: str, inv_scale: str, out: str) -> str:
        scaled = self.node("Mul", [x, inv_scale], f"{out}.scaled")
        rounded = self.node("Round", [scaled], f"{out}.rounded")
        clipped = self.node("Clip", [rounded, "kv_int8.qmin", "kv_int8.qmax"], f"{out}.clipped")
        return self.node("Cast", [clipped], out, to=self.onnx.TensorProto.INT8)

    def dequantize(self, q: str, scale: str, out: str) -> str:
        as_float = self.node("Cast", [q], f"{out}.float", to=self.onnx.TensorProto.FLOAT)
        return self.node("Mul", [as_float, scale], out)

    def finish(self) -> None:
        """Put the new nodes in: a stable topological order of old and new nodes."""
        pending = list(self.graph.node) + self.nodes
        ready = {""} | {v.name for v in self.graph.input} | {i.name for i in self.graph.initializer}
        ordered = []
        while pending:
            left = []
            for node in pending:
                if all(i in ready for i in node.input):
                    ordered.append(node)
                    ready.update(node.output)
                else:
                    left.append(node)
            if len(left) == len(pending):
                raise ArtifactError(f"KV rewrite left {left[0].name} waiting for an input nothing produces")
            pending = left
        del self.graph.node[:]
        self.graph.node.extend(ordered)


def _set_int8(values, name: str) -> None:
    import onnx

    for v in values:
        if v.name == name:
            v.type.tensor_type.elem_type = onnx.TensorProto.INT8
            return
    raise ArtifactError(f"graph has no tensor {name}")


def _add_scales(rw: _Rewriter, names: list[str], scales: list[np.ndarray]) -> list[tuple[str, str]]:
    rw.constant("kv_int8.qmin", np.array(-QMAX, np.float32))
    rw.constant("kv_int8.qmax", np.array(QMAX, np.float32))
    out = []
    for name, s in zip(names, scales):
        shaped = s.reshape(1, s.shape[0], 1, s.shape[1]).astype(np.float32)  # [1, Hkv, 1, D] broadcasts over B and slots
        out.append((rw.constant(f"kv_int8.scale.{name}", shaped), rw.constant(f"kv_int8.inv_scale.{name}", 1.0 / shaped)))
    return out


def rewrite_prefill(model, present: list[str], scales: list[np.ndarray]) -> None:
    """Prefill's present outputs leave the graph quantized; attention keeps the float values."""
    rw = _Rewriter(model)
    for name, (_, inv) in zip(present, _add_scales(rw, present, scales)):
        float_name = f"{name}.fp32"
        for node in model.graph.node:
            node.output[:] = [float_name if o == name else o for o in node.output]
            node.input[:] = [float_name if i == name else i for i in node.input]
        rw.quantize(float_name, inv, name)
        _set_int8(model.graph.output, name)
    rw.finish()


def rewrite_decode(model, past: list[str], present: list[str], scales: list[np.ndarray]) -> None:
    """Decode reads the int8 cache dequantized and scatters the new keys/values quantized."""
    if any(n.op_type == "GroupQueryAttention" for n in model.graph.node):
        return rewrite_fused_decode(model, past, present, scales)
    rw = _Rewriter(model)
    for p, r, (scale, inv) in zip(past, present, _add_scales(rw, present, scales)):
        scatter = next((n for n in model.graph.node if n.op_type == "ScatterElements" and n.input[0] == p and r in n.output), None)
        if scatter is None:
            raise InputError(f"the decode graph updates {p} neither with ScatterElements nor with GroupQueryAttention: "
                             "cannot quantize its KV cache")
        scatter.input[2] = rw.quantize(scatter.input[2], inv, f"{r}.new_int8")
        for tensor in (p, r):  # every other reader of the cache gets dequantized values
            whole = None
            for node in list(model.graph.node):
                if node is scatter or tensor not in node.input or node.op_type == "Shape":
                    continue
                if node.op_type == "Slice" and node.input[0] == tensor:  # attention's window: dequantize only it
                    sliced = node.output[0]
                    node.output[0] = f"{sliced}.int8"
                    rw.dequantize(node.output[0], scale, sliced)
                    continue
                whole = whole or rw.dequantize(tensor, scale, f"{tensor}.dequantized")
                node.input[:] = [whole if i == tensor else i for i in node.input]
        _set_int8(model.graph.input, p)
        _set_int8(model.graph.output, r)
    rw.finish()


# GroupQueryAttention's inputs (ONNX Runtime 1.31): ... 10 attention_bias, 11 head_sink,
# 12 k_scale, 13 v_scale.
_GQA_K_SCALE, _GQA_V_SCALE = 12, 13


def rewrite_fused_decode(model, past: list[str], present: list[str], scales: list[np.ndarray]) -> None:
    """Fused decode: GroupQueryAttention reads and writes the int8 cache itself (ONNX Runtime's
    quantized cache, ``k_quant_type``/``v_quant_type`` PER_CHANNEL, rounding to nearest like
    ``quantize``), so no dequantized copy of the window is made."""
    import onnx

    attention = [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]
    for node in attention:
        if len(node.output) < 3 or node.output[1] not in present or len(node.input) < 5 or node.input[3] not in past:
            raise ArtifactError(f"{node.name} does not update the KV cache in place: cannot quantize its cache")
    written = {name for node in attention for name in node.output[1:3]}
    missing = [r for r in present if r not in written]
    if missing:  # an int8 buffer that no GroupQueryAttention writes would be read as float by its own layer
        raise ArtifactError(f"the decode graph's GroupQueryAttention does not write {missing[0]}: cannot quantize its cache")
    rw = _Rewriter(model)
    scale_of = dict(zip(present, scales))
    for node in attention:
        inputs = list(node.input) + [""] * (_GQA_V_SCALE + 1 - len(node.input))
        for slot, name in ((_GQA_K_SCALE, node.output[1]), (_GQA_V_SCALE, node.output[2])):
            s = scale_of[name]
            inputs[slot] = rw.constant(f"kv_int8.scale.{name}", s[:, None, :].astype(np.float32))  # [Hkv, 1, D]
        node.input[:] = inputs
        node.attribute.extend(onnx.helper.make_attribute(k, v) for k, v in
                              (("k_quant_type", "PER_CHANNEL"), ("v_quant_type", "PER_CHANNEL"), ("kv_cache_bit_width", 8)))
    for p, r in zip(past, present):
        _set_int8(model.graph.input, p)
        _set_int8(model.graph.output, r)
    rw.finish()


def kv_names(manifest: Manifest) -> tuple[list[str], list[str]]:
    return manifest.kv.past_names(), manifest.kv.present_names()


def check_quantizable(manifest: Manifest) -> None:
    if manifest.kind != "decoder":
        raise InputError(f"an INT8 KV cache applies to decoders; this artifact is an {manifest.kind}")
    if manifest.kv.dtype != "float32":
        raise InputError(f"the KV cache is already {manifest.kv.dtype}; INT8 KV quantizes a float32 cache")


def quantize_kv_graphs(models: dict, manifest: Manifest, scales: list[np.ndarray]) -> None:
    """Rewrite ``models`` (prefill and decode) in place for an int8 cache with ``scales``."""
    past, present = kv_names(manifest)
    rewrite_prefill(models["prefill"], present, scales)
    rewrite_decode(models["decode"], past, present, scales)


def kv_record(scales: list[np.ndarray], windows: list[list[int]]) -> dict:
    """The manifest's ``kv.quantization``: how the cache is stored and where the scales came from."""
    flat = np.concatenate([s.ravel() for s in scales])
    return {"dtype": "int8", "symmetric": True, "granularity": "per kv head and channel (static)",
            "method": "absmax", "rope_pairs_tied": True, "scale_tensors": "kv_int8.scale.<present name>",
            "calibration_windows": len(windows), "calibration_tokens": int(sum(len(w) for w in windows)),
            "scale_min": float(flat.min()), "scale_max": float(flat.max())}


def calibrate_kv(source: Artifact, windows: list[list[int]], threads: int | None = None) -> list[np.ndarray]:
    """Scales for an int8 cache of ``source``, from its own keys/values on ``windows``."""
    check_quantizable(source.manifest)
    backend = make_backend(source, "ort-cpu", threads=threads, lazy_prefill=False)  # the prefill graph's KV too
    return kv_scales(kv_absmax(backend, windows), rope=source.manifest.model.position == "rope")


def mark_kv_int8(manifest: Manifest, scales: list[np.ndarray], windows: list[list[int]]) -> None:
    """Record the int8 cache in a new artifact's manifest (its graphs already describe int8 IO)."""
    manifest.kv = dataclasses.replace(manifest.kv, dtype="int8", quantization=kv_record(scales, windows))
    manifest.precision = dataclasses.replace(manifest.precision, kv_cache="int8")


def quantize_kv_artifact(src: str | Path | Artifact, out: str | Path, windows: list[list[int]],
                         threads: int | None = None, force: bool = False) -> Manifest:
    """A copy of artifact ``src`` at ``out`` whose KV cache is int8, calibrated on token ``windows``
    (``llmx calibrate --kv-cache int8`` does the same from text, and reports the quality)."""
    source = Artifact.of(src)
    manifest = source.manifest
    scales = calibrate_kv(source, windows, threads)
    with staged_artifact(out, overwrite=force) as tmp:
        models = {name: load_graph(source.graph_path(name)) for name in manifest.graphs}
        quantize_kv_graphs(models, manifest, scales)
        save_graphs(models, tmp, sources={name: source.root for name in models})
        copy_tokenizer(source.root, tmp)
        new = manifest.with_stage("kv-int8", windows=len(windows))
        new.graphs = {name: describe_graph(models[name], spec.file, ops=spec.ops) for name, spec in manifest.graphs.items()}
        mark_kv_int8(new, scales, windows)
        return finish(tmp, new)
