"""MatMulNBits tensors stored in the bits their values need, rebuilt when ONNX Runtime loads the graph.

ONNX Runtime's CPU kernels take 4 or 8 bits and float32 scales, so a GGUF's Q5_0 block (32
five-bit codes and an fp16 scale: 5.5 bits a weight) is 9 bits a weight as MatMulNBits reads it,
and Q6_K's 6.6 become 10: SmolLM2's Q4_K_M file made an artifact 1.43x its size. Here each such
tensor is written in the fewest bits that hold its values exactly, and a few nodes rebuild the
tensor MatMulNBits reads:

- 8-bit codes that span at most 64 values: ``codes - lowest`` as a nibble plus a 1- or 2-bit
  field (5 or 6 bits a code), rebuilt by BitShift / BitwiseAnd / BitwiseOr / Add on uint8;
- float32 scales and offsets that are fp16 values (every d of a GGUF's Q8_0, Q4_0, Q4_1, Q5_0,
  Q5_1 block, a GPTQ checkpoint's scales) as fp16, rebuilt by Cast;
- K-quant scales, an fp16 d per super-block times a small integer per block
  (``Blocks.scale_units``), as those two, rebuilt by Cast and Mul (exact in float32).

Every input of those nodes is an initializer, so ONNX Runtime's constant folding (any graph
optimization level but "none") computes them once when the session is made, before the kernels
pack their weights: the same kernels then run on the same values, only the file is smaller and
the load does a little more. (At level "none" MatMulNBits reads the unfolded tensors and gives
zeros, measured with ONNX Runtime 1.31: llmx never loads such a graph at that level.) Floats are
checked against the array they replace before they are kept.

Folding holds every intermediate of every rebuild until the pass ends (SmolLM2's Q4_K_M: a 0.9 GB
peak for 0.1 GB of codes), so llmx's own runtime does not leave it to the optimizer:
``runtime/rebuilt_weights.py`` runs the rebuilds once, one tensor's intermediates at a time, and
hands the results to both sessions as their initializers. The graph's metadata lists the rebuilt
tensors (``MARK``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from llmx.quant_blocks import Blocks

MARK = "llmx.rebuilt_at_load"  # doc_string of a placeholder and metadata key of a graph holding rebuilds
REBUILT = "rebuilt_at_load"  # the manifest's extras record: {"tensors": n, "load_bytes": bytes added at load}


@dataclass
class Rebuilt:
    """A tensor MatMulNBits (or the embedding lookup) reads, stored smaller: ``stored`` (name,
    array) go to weights.bin and ``nodes`` compute ``name`` from them."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    stored: list[tuple[str, np.ndarray]]
    nodes: list  # onnx.NodeProto

    @property
    def stored_bytes(self) -> int:
        return sum(a.nbytes for _, a in self.stored)

    @property
    def rebuilt_bytes(self) -> int:
        return int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize


def compact_arrays(blocks: Blocks, weight: str) -> list[tuple[str, np.ndarray] | Rebuilt]:
    """``blocks.arrays(weight)``, each replaced by a ``Rebuilt`` where fewer bits hold it exactly."""
    out: list[tuple[str, np.ndarray] | Rebuilt] = []
    for name, array in blocks.arrays(weight):
        rebuilt = None
        if name.endswith("_Q8"):
            rebuilt = _narrow_codes(name, array)
        elif name.endswith("_scales") and blocks.scale_units is not None:
            rebuilt = _unit_times_integer(name, array, *blocks.scale_units) or _half(name, array)
        elif array.dtype == np.float32:
            rebuilt = _half(name, array)
        out.append(rebuilt or (name, array))
    return out


def rebuilt_tensors(model) -> dict[str, int]:
    """The tensors ``model`` (an onnx.ModelProto, weights not loaded) rebuilds from smaller ones:
    name -> ONNX element type."""
    return {n: t for p in model.metadata_props if p.key == MARK for n, t in json.loads(p.value).items()}


def expand_in_graph(model, rebuilt: dict[str, tuple[list, list]]) -> int:
    """Replace each placeholder initializer of ``model`` named in ``rebuilt`` (name -> (stored
    TensorProtos, nodes)) by its stored tensors and the nodes computing it; returns how many."""
    inits = {i.name: i for i in model.graph.initializer}
    names = [n for n in inits if n in rebuilt]
    if any(i.doc_string == MARK and i.name not in rebuilt for i in inits.values()):
        raise ValueError("internal error: a placeholder initializer has no rebuild")
    if not names:
        return 0
    nodes, types = [], {}
    for name in names:
        types[name] = inits[name].data_type
        model.graph.initializer.remove(inits.pop(name))
        stored, more = rebuilt[name]
        for tensor in stored:
            if tensor.name not in inits:
                model.graph.initializer.append(tensor)
                inits[tensor.name] = tensor
        nodes.extend(more)
    # The nodes read initializers only, so they can go first: the graph stays topologically sorted.
    existing = list(model.graph.node)
    del model.graph.node[:]
    model.graph.node.extend([*nodes, *existing])
    entry = model.metadata_props.add()
    entry.key, entry.value = MARK, json.dumps(types)
    return len(names)


# ---- codes ------------------------------------------------------------------------------------

def _narrow_codes(name: str, codes: np.ndarray) -> Rebuilt | None:
    """8-bit codes [N, blocks, block] as (codes - lowest) in 5 or 6 bits: a nibble, a 1-2 bit field."""
    if codes.ndim != 3 or codes.shape[-1] % 8:
        return None
    lowest, span = int(codes.min()), int(codes.max()) - int(codes.min()) + 1
    if span > 64:
        return None
    high_bits = 0 if span <= 16 else 1 if span <= 32 else 2
    rest = (codes - np.uint8(lowest)).astype(np.uint8)
    low = rest & 0x0F
    stored = [(f"{name}_low", np.ascontiguousarray(low[..., 0::2] | (low[..., 1::2] << 4)))]
    if high_bits:
        per = 8 // high_bits
        fields = (rest >> 4).reshape(*rest.shape[:-1], -1, per)
        shifts = (np.arange(per, dtype=np.uint8) * high_bits)
        stored.append((f"{name}_high", np.bitwise_or.reduce(fields << shifts, axis=-1).astype(np.uint8)))
    return Rebuilt(name, codes.shape, np.uint8, stored, _codes_nodes(name, lowest, high_bits))


def _codes_nodes(name: str, lowest: int, high_bits: int) -> list:
    from onnx import helper

    c = _Consts(name)
    nodes = [
        helper.make_node("BitwiseAnd", [f"{name}_low", c.u8(0x0F)], [f"{name}_even"]),
        helper.make_node("BitShift", [f"{name}_low", c.u8(4)], [f"{name}_odd"], direction="RIGHT"),
        helper.make_node("Unsqueeze", [f"{name}_even", c.axis], [f"{name}_even1"]),
        helper.make_node("Unsqueeze", [f"{name}_odd", c.axis], [f"{name}_odd1"]),
        helper.make_node("Concat", [f"{name}_even1", f"{name}_odd1"], [f"{name}_pairs"], axis=-1),
        helper.make_node("Reshape", [f"{name}_pairs", c.flat], [f"{name}_nibbles"]),
    ]
    rest = f"{name}_nibbles"
    if high_bits:
        per = 8 // high_bits
        nodes += [
            helper.make_node("Unsqueeze", [f"{name}_high", c.axis], [f"{name}_high1"]),
            helper.make_node("BitShift", [f"{name}_high1", c.u8(np.arange(per) * high_bits)], [f"{name}_fields"],
                             direction="RIGHT"),
            helper.make_node("BitwiseAnd", [f"{name}_fields", c.u8((1 << high_bits) - 1)], [f"{name}_field"]),
            helper.make_node("Reshape", [f"{name}_field", c.flat], [f"{name}_tops"]),
            helper.make_node("BitShift", [f"{name}_tops", c.u8(4)], [f"{name}_top"], direction="LEFT"),
            helper.make_node("BitwiseOr", [f"{name}_nibbles", f"{name}_top"], [f"{name}_rest"]),
        ]
        rest = f"{name}_rest"
    nodes.append(helper.make_node("Add", [rest, c.u8(lowest)], [name]))
    return [*c.nodes, *_named(nodes, name)]


# ---- floats -----------------------------------------------------------------------------------

def _half(name: str, values: np.ndarray) -> Rebuilt | None:
    """float32 values that are all fp16 values, as fp16 (Cast back: exact)."""
    from onnx import TensorProto, helper

    if values.dtype != np.float32 or values.size < 64:
        return None
    with np.errstate(over="ignore"):
        half = values.astype(np.float16)
    if not np.array_equal(half.astype(np.float32), values, equal_nan=True):
        return None
    node = helper.make_node("Cast", [f"{name}_f16"], [name], to=TensorProto.FLOAT, name=f"{name}_rebuild_cast")
    return Rebuilt(name, values.shape, np.float32, [(f"{name}_f16", half)], [node])


def _unit_times_integer(name: str, scales: np.ndarray, units: np.ndarray, group: int) -> Rebuilt | None:
    """scales [N, blocks] = units [N, blocks / group] (fp16 values) x an integer per block (int8 or
    uint8), computed in float32 as the GGUF decoder computes them."""
    from onnx import TensorProto, helper

    n, nb = scales.shape
    if nb % group or units.shape != (n, nb // group):
        return None
    unit16 = units.astype(np.float16)
    per_block = np.repeat(units, group, axis=1)
    safe = np.where(per_block == 0, np.float32(1), per_block)
    factor = np.round(scales / safe)
    kind = np.uint8 if factor.min() >= 0 else np.int8
    info = np.iinfo(kind)
    if factor.min() < info.min or factor.max() > info.max:
        return None
    factor = factor.astype(kind)
    if not (np.array_equal(unit16.astype(np.float32), units)
            and np.array_equal(per_block * factor.astype(np.float32), scales)):
        return None
    c = _Consts(name)
    nodes = _named([
        helper.make_node("Cast", [f"{name}_units"], [f"{name}_units32"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", [f"{name}_units32", c.axis], [f"{name}_units3"]),
        helper.make_node("Cast", [f"{name}_factors"], [f"{name}_factors32"], to=TensorProto.FLOAT),
        helper.make_node("Reshape", [f"{name}_factors32", c.i64([n, nb // group, group])], [f"{name}_factors3"]),
        helper.make_node("Mul", [f"{name}_units3", f"{name}_factors3"], [f"{name}_scales3"]),
        helper.make_node("Reshape", [f"{name}_scales3", c.i64([n, nb])], [name]),
    ], name)
    return Rebuilt(name, scales.shape, np.float32, [(f"{name}_units", unit16), (f"{name}_factors", factor)],
                   [*c.nodes, *nodes])


# ---- helpers ----------------------------------------------------------------------------------

class _Consts:
    """Small constants for one rebuild, as Constant nodes (folded with the rest)."""

    def __init__(self, prefix: str):
        self.prefix, self.nodes = prefix, []
        self.axis = self.i64([-1])
        self.flat = self.i64([0, 0, -1])

    def _add(self, array: np.ndarray) -> str:
        from onnx import helper, numpy_helper

        out = f"{self.prefix}_const{len(self.nodes)}"
        self.nodes.append(helper.make_node("Constant", [], [out], name=f"{out}_node",
                                           value=numpy_helper.from_array(array, f"{out}_value")))
        return out

    def u8(self, value) -> str:
        return self._add(np.array(value, dtype=np.uint8))

    def i64(self, value) -> str:
        return self._add(np.array(value, dtype=np.int64))


def _named(nodes: list, prefix: str) -> list:
    for j, node in enumerate(nodes):
        if not node.name:
            node.name = f"{prefix}_rebuild{j}"
    return nodes


def run_rebuild(rebuilt: Rebuilt) -> np.ndarray:
    """The tensor ``rebuilt``'s nodes compute from its stored arrays, as ONNX Runtime folds them."""
    import onnxruntime as ort
    from onnx import helper, numpy_helper

    out = helper.make_tensor_value_info(rebuilt.name, helper.np_dtype_to_tensor_dtype(np.dtype(rebuilt.dtype)), None)
    graph = helper.make_graph(rebuilt.nodes, "rebuild", [], [out], [numpy_helper.from_array(a, n) for n, a in rebuilt.stored])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {})[0]
