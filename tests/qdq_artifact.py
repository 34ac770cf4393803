"""A symmetric INT8 Q/DQ artifact made with ONNX Runtime's quantizer: a stand-in for what
``llmx calibrate`` is expected to write (precision.scheme "w8a8", standard Q/DQ nodes with
zero points 0), so llmx build's INT8 path is tested without depending on that command."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np


def calibration_feeds(manifest, graph: str, rng, count: int = 4) -> list[dict]:
    vocab, kv = manifest.model.vocab_size, manifest.kv
    feeds = []
    for _ in range(count):
        if graph == "prefill":
            s = 6
            feeds.append({"input_ids": rng.integers(0, vocab, (1, s)), "attention_mask": np.ones((1, s), np.int64),
                          "position_ids": np.arange(s)[None]})
            continue
        t, total, capacity = 2, 6, 8
        feed = {"input_ids": rng.integers(0, vocab, (1, t)), "attention_mask": np.ones((1, total), np.int64),
                "position_ids": np.arange(total - t, total)[None]}
        for i in range(kv.num_layers):
            for part in ("key", "value"):
                shape = (1, kv.num_kv_heads, capacity, kv.head_dim)
                feed[kv.past.format(i=i, kv=part)] = rng.standard_normal(shape).astype(np.float32)
        feeds.append(feed)
    return feeds


def make_qdq_artifact(src: Path, out: Path) -> Path:
    import onnx
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    from llmx.artifact.staging import copy_tokenizer, finish, staged_artifact
    from llmx.artifact.manifest import load_manifest
    from llmx.artifact.onnx_files import describe_graph, load_graph, save_graphs

    class Reader(CalibrationDataReader):
        def __init__(self, feeds):
            self.feeds = iter(feeds)

        def get_next(self):
            return next(self.feeds, None)

    manifest, rng = load_manifest(src), np.random.default_rng(0)
    with staged_artifact(out) as tmp:
        graphs = {}
        for name, spec in manifest.graphs.items():
            scratch = tmp / f"{name}.quantized.onnx"
            quantize_static(str(src / spec.file), str(scratch), Reader(calibration_feeds(manifest, name, rng)),
                            quant_format=QuantFormat.QDQ, activation_type=QuantType.QInt8, weight_type=QuantType.QInt8,
                            op_types_to_quantize=["MatMul"], extra_options={"ActivationSymmetric": True, "WeightSymmetric": True})
            graphs[name] = onnx.load(str(scratch))
            scratch.unlink()
        save_graphs(graphs, tmp)
        copy_tokenizer(src, tmp)
        described = {name: describe_graph(load_graph(tmp / s.file), s.file) for name, s in manifest.graphs.items()}
        new = dataclasses.replace(manifest, graphs=described,
                                  precision={"weights": "int8", "activations": "int8", "scheme": "w8a8"})
        finish(tmp, new.with_stage("calibrate", tool="onnxruntime.quantization (test stand-in)"))
    return out
