"""Block tensors stored in the bits their values need (llmx/compact_blocks.py): each rebuild, run by
ONNX Runtime, gives back exactly the array it replaces, in fewer bytes; what cannot be stored
smaller exactly is left as it is."""

from __future__ import annotations

import numpy as np
import pytest

from llmx.compact_blocks import Rebuilt, compact_arrays, run_rebuild
from llmx.quant_blocks import Blocks


def _blocks(codes: np.ndarray, scales: np.ndarray, units=None) -> Blocks:
    return Blocks(8, codes, scales, None, codes.shape[-1], scale_units=units)


def _by_name(items) -> dict:
    return {(i.name if isinstance(i, Rebuilt) else i[0]): i for i in items}


@pytest.mark.parametrize("lowest,span,stored_fraction", [(112, 32, 5 / 8), (96, 64, 6 / 8), (120, 16, 4 / 8), (3, 1, 4 / 8)])
def test_narrow_codes_rebuild_exactly(lowest, span, stored_fraction):
    rng = np.random.default_rng(span)
    codes = rng.integers(lowest, lowest + span, (24, 5, 32), dtype=np.uint8)
    codes.flat[0], codes.flat[-1] = lowest, lowest + span - 1  # the whole span is used
    item = _by_name(compact_arrays(_blocks(codes, np.ones((24, 5), np.float32)), "w"))["w_Q8"]
    assert isinstance(item, Rebuilt)
    assert item.stored_bytes == pytest.approx(codes.nbytes * stored_fraction)
    assert item.rebuilt_bytes == codes.nbytes
    rebuilt = run_rebuild(item)
    assert rebuilt.dtype == np.uint8 and np.array_equal(rebuilt, codes)


def test_full_range_codes_stay_as_they_are():
    codes = np.arange(256, dtype=np.uint8).reshape(4, 2, 32)
    item = _by_name(compact_arrays(_blocks(codes, np.ones((4, 2), np.float32)), "w"))["w_Q8"]
    assert not isinstance(item, Rebuilt) and item[1] is codes


def test_fp16_scales_are_stored_as_fp16_and_others_are_not():
    rng = np.random.default_rng(0)
    halves = rng.standard_normal((16, 8)).astype(np.float16).astype(np.float32)
    codes = rng.integers(0, 256, (16, 8, 32), dtype=np.uint8)
    item = _by_name(compact_arrays(_blocks(codes, halves), "w"))["w_scales"]
    assert isinstance(item, Rebuilt) and item.stored_bytes == halves.nbytes // 2
    assert np.array_equal(run_rebuild(item), halves)
    floats = halves + np.float32(1e-6)  # float32 values no fp16 holds
    kept = _by_name(compact_arrays(_blocks(codes, floats), "w"))["w_scales"]
    assert not isinstance(kept, Rebuilt)


def test_k_quant_scales_are_stored_as_units_times_integers():
    rng = np.random.default_rng(1)
    units = (rng.random((8, 3)) * 1e-2).astype(np.float16).astype(np.float32)  # an fp16 d per super-block
    factors = rng.integers(-32, 32, (8, 3 * 8)).astype(np.float32)  # Q3_K's sc - 32
    scales = (np.repeat(units, 8, axis=1) * factors).astype(np.float32)
    codes = rng.integers(0, 256, (8, 24, 16), dtype=np.uint8)
    item = _by_name(compact_arrays(_blocks(codes, scales, (units, 8)), "w"))["w_scales"]
    assert isinstance(item, Rebuilt) and [n for n, _ in item.stored] == ["w_scales_units", "w_scales_factors"]
    assert item.stored_bytes == units.size * 2 + scales.size  # fp16 units, int8 factors
    assert np.array_equal(run_rebuild(item), scales)
    # A stale hint (scales changed after it was made) is not trusted: checked, then dropped.
    wrong = scales * np.float32(1.0001)
    kept = _by_name(compact_arrays(_blocks(codes, wrong, (units, 8)), "w"))["w_scales"]
    assert not isinstance(kept, Rebuilt) or np.array_equal(run_rebuild(kept), wrong)


def test_scaling_blocks_drops_the_units_hint():
    units = np.ones((2, 1), np.float32)
    blocks = _blocks(np.zeros((2, 8, 32), np.uint8), np.ones((2, 8), np.float32), (units, 8))
    assert blocks.scaled(lambda s: s * 3).scale_units is None
    assert blocks.rows(np.array([1, 0])).scale_units[1] == 8


def test_a_graph_with_its_weights_inline_is_left_to_onnx_runtimes_folding(tmp_path):
    """The runtime's own rebuild names the graph's weights file in its placeholders; a graph whose
    tensors are all inline has none, and loads as it is (ONNX Runtime folds the same values)."""
    import onnx
    import onnxruntime as ort
    from onnx import helper, numpy_helper

    from llmx.compact_blocks import MARK, expand_in_graph
    from llmx.runtime.rebuilt_weights import RebuiltWeights

    codes = np.random.default_rng(0).integers(112, 144, (8, 2, 32), dtype=np.uint8)
    item = _by_name(compact_arrays(_blocks(codes, np.ones((8, 2), np.float32)), "w"))["w_Q8"]
    placeholder = numpy_helper.from_array(np.empty(0, np.uint8), item.name)
    del placeholder.dims[:]
    placeholder.dims.extend(item.shape)
    placeholder.doc_string = MARK
    out = helper.make_tensor_value_info("out", onnx.TensorProto.UINT8, None)
    graph = helper.make_graph([helper.make_node("Identity", [item.name], ["out"])], "g", [], [out], [placeholder])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    stored = [numpy_helper.from_array(values, name) for name, values in item.stored]
    assert expand_in_graph(model, {item.name: (stored, item.nodes)}) == 1
    path = tmp_path / "inline.onnx"
    onnx.save_model(model, str(path))
    opts = ort.SessionOptions()
    assert RebuiltWeights().prepare(path, opts) == str(path)
    session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(session.run(None, {})[0], codes)
