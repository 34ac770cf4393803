"""``llmx export --verify``: run the exported graphs on ONNX Runtime and compare with PyTorch.

Checks a padded batch through prefill and several decode steps (one token, then three at once)
against llmx's own torch modules carrying the same weights. Runs on the staged artifact before
it is renamed into place, so a failed check leaves nothing behind.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from llmx.compare import max_abs_diff
from llmx.errors import LlmxError
from llmx.export.modules import Decoder
from llmx.export.onnx_export import past_names


class VerificationError(LlmxError):
    pass


def _close(name: str, got: np.ndarray, want: np.ndarray, atol: float, rtol: float) -> float:
    diff = max_abs_diff(got, want)
    bound = atol + rtol * float(np.abs(want).max())
    if not np.isfinite(diff) or diff > bound:
        raise VerificationError(f"verification failed: {name} differs from PyTorch by {diff:.3g} (allowed {bound:.3g})")
    return diff


def _session(path: Path):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def verify_export(model, artifact: Path, atol: float = 1e-4, rtol: float = 1e-5, seed: int = 0) -> dict:
    if model.spec.kind == "encoder":
        return _verify_encoder(model, artifact, atol, rtol, seed)
    return _verify_decoder(model, artifact, atol, rtol, seed)


def _verify_encoder(model, artifact: Path, atol: float, rtol: float, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, model.spec.vocab_size, (3, 11), dtype=np.int64)
    mask = np.ones_like(ids)
    mask[1, 6:] = 0  # a padded row: pooling must ignore the padding
    types = np.zeros_like(ids)
    got = _session(artifact / "embed.onnx").run(None, {"input_ids": ids, "attention_mask": mask, "token_type_ids": types})[0]
    with torch.no_grad():
        want = model(*map(torch.from_numpy, (ids, mask, types))).numpy()
    return {"max_abs_diff": _close("embeddings", got, want, atol, rtol), "atol": atol, "rtol": rtol}


def _verify_decoder(model: Decoder, artifact: Path, atol: float, rtol: float, seed: int) -> dict:
    spec = model.spec
    rng = np.random.default_rng(seed)
    seq = min(12, spec.max_position_embeddings - 4)
    ids = rng.integers(0, spec.vocab_size, (2, seq), dtype=np.int64)
    mask = np.ones_like(ids)
    mask[1, : seq // 3] = 0  # left-padded second row
    pos = np.clip(np.cumsum(mask, 1) - 1, 0, None)
    prefill, decode = _session(artifact / "prefill.onnx"), _session(artifact / "decode.onnx")
    worst = 0.0
    with torch.no_grad():
        got = prefill.run(None, {"input_ids": ids, "attention_mask": mask, "position_ids": pos})
        want = model.prefill(*map(torch.from_numpy, (ids, mask, pos)))
        for i, (g, w) in enumerate(zip(got, want)):
            worst = max(worst, _close(f"prefill output {i}", g, w.numpy(), atol, rtol))

        # Decode one row (row 0 is unpadded): slot == position.
        capacity = seq + 8
        past = [np.zeros((1, spec.num_kv_heads, capacity, spec.head_dim), np.float32) for _ in range(2 * spec.num_layers)]
        for p, present in zip(past, got[1:]):
            p[:, :, :seq] = present[:1]
        length = seq
        for step, new in enumerate((1, 1, 3)):
            new_ids = rng.integers(0, spec.vocab_size, (1, new), dtype=np.int64)
            positions = np.arange(length, length + new, dtype=np.int64)[None]
            amask = np.ones((1, length + new), np.int64)
            feed = {"input_ids": new_ids, "attention_mask": amask, "position_ids": positions}
            feed.update(zip(past_names(spec.num_layers), past))
            out = decode.run(None, feed)
            ref = model.decode(*map(torch.from_numpy, (new_ids, amask, positions)), *map(torch.from_numpy, past))
            worst = max(worst, _close(f"decode step {step} logits", out[0], ref[0].numpy(), atol, rtol))
            past = out[1:]
            length += new
    return {"max_abs_diff": worst, "atol": atol, "rtol": rtol}
