"""A model with planted activation outliers, the failure mode of small real LLMs under W8A8.

A few channels of some layers' RMSNorm weight are multiplied by ``factor`` and the same rows of
the MatMul reading that norm are divided by it: the function is unchanged (up to float
rounding), but those MatMuls' inputs carry channels ``factor`` times louder than the rest, as
measured in real 100M-class models. Edited in the exported ONNX graphs of both prefill and
decode, so no export is needed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

CHANNELS = (3, 77, 190)


def plant_outliers(src: Path, out: Path, layers: tuple[int, ...], factor: float = 80.0,
                   norm: str = "attn_norm", matmul: str = "attn.qkv") -> list[str]:
    """Copy artifact ``src`` to ``out`` with outliers before ``layers``; returns the planted MatMuls' weights."""
    from llmx.artifact.staging import copy_tokenizer, finish
    from llmx.calibration.matmuls import initializers, read_array, replace_initializer
    from llmx.artifact.manifest import load_manifest
    from llmx.artifact.onnx_files import describe_graph, load_graph, save_graphs

    manifest = load_manifest(src)
    models = {name: load_graph(src / spec.file) for name, spec in manifest.graphs.items()}
    planted = []
    for model in models.values():
        inits = initializers(model)
        for layer in layers:
            gamma_name = next(n for n in inits if n.endswith(f"layers.{layer}.{norm}.weight"))
            weight_name = next(n for n in inits if n.endswith(f"layers.{layer}.{matmul}.weight"))
            gamma, weight = read_array(inits[gamma_name], src).copy(), read_array(inits[weight_name], src).copy()
            gamma[list(CHANNELS)] *= factor
            weight[list(CHANNELS)] /= factor
            replace_initializer(model, gamma_name, gamma.astype(np.float32))
            replace_initializer(model, weight_name, weight.astype(np.float32))
            planted.append(weight_name)
    out.mkdir(parents=True)
    save_graphs(models, out, sources={name: src for name in models})
    copy_tokenizer(src, out)
    manifest.graphs = {name: describe_graph(model, f"{name}.onnx", ops=manifest.graphs[name].ops)
                       for name, model in models.items()}
    finish(out, manifest)
    return sorted(set(planted))
