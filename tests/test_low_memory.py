"""--low-memory: the ONNX Runtime CPU backend reads the weights from the memory-mapped weights.bin
instead of packing a private copy per graph. Same numbers, one shared copy; refused where it would
only slow things down (quantized kernels) or cannot apply (other backends)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from checkpoints import make_checkpoint
from llmx.errors import ArtifactError, InputError
from llmx.artifact import Artifact
from llmx.runtime.onnx_backend import OrtBackend
from test_cli import error_line, run


def _backend(artifact: Path, **options) -> OrtBackend:
    return OrtBackend(Artifact.open(artifact), threads=1, lazy_prefill=False, **options)


def _logits(backend: OrtBackend, prompt: list[int], steps: int) -> list[np.ndarray]:
    cache = backend.new_cache(1, len(prompt) + steps)
    out = [backend.prefill(cache, [0], [prompt])[0].copy()]
    for _ in range(steps):
        out.append(backend.decode(cache, np.array([[int(out[-1].argmax())]]))[0, -1].copy())
    return out


def test_sessions_skip_packing_and_compute_the_same_logits(llama_artifact):
    default, low = _backend(llama_artifact), _backend(llama_artifact, low_memory=True)
    for name in ("prefill", "decode"):
        assert low.sessions[name].get_session_options().get_session_config_entry("session.disable_prepacking") == "1"
        with pytest.raises(RuntimeError, match="does not have configuration"):  # never set: ORT's default, packing on
            default.sessions[name].get_session_options().get_session_config_entry("session.disable_prepacking")
    for a, b in zip(_logits(default, [1, 5, 9, 14, 3], 6), _logits(low, [1, 5, 9, 14, 3], 6)):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_refused_for_quantized_artifacts(llama_artifact, tmp_path):
    quantized = tmp_path / "w8"
    manifest = json.loads((llama_artifact / "llmx.json").read_text())
    manifest["precision"]["scheme"] = "w8"
    # A copy, not symlinks (an artifact's files may not lead outside it) nor hardlinks (onnx refuses
    # external data with several links, and the session artifact is shared).
    shutil.copytree(llama_artifact, quantized, ignore=shutil.ignore_patterns("llmx.json"))
    (quantized / "llmx.json").write_text(json.dumps(manifest))
    with pytest.raises(InputError, match="unquantized artifacts; this one is w8"):
        _backend(quantized, low_memory=True)


def test_cli_flag_reaches_the_backend_and_is_checked(llama_artifact, capsys):
    code, out, _ = run(["bench", str(llama_artifact), "--prompt-len", "4", "--new-tokens", "3", "--repeat", "1",
                        "--warmup", "0", "--threads", "1", "--low-memory", "--json"], capsys)
    result = json.loads(out)
    assert code == 0 and result["low_memory"] is True
    if Path("/proc/self/smaps_rollup").exists():  # PSS <= RSS now <= peak RSS
        assert 0 < result["pss_mb"] <= result["peak_rss_mb"]
    code, out, _ = run(["generate", str(llama_artifact), "def f", "--max-new-tokens", "4", "--temperature", "0",
                        "--low-memory", "--json"], capsys)
    assert code == 0 and json.loads(out)["text"]
    code, _, err = run(["generate", str(llama_artifact), "def f", "--backend", "tensorrt", "--low-memory"], capsys)
    assert code != 0 and "--low-memory applies to --backend ort-cpu" in error_line(err)


_MEMORY = textwrap.dedent("""
    import json, sys
    import numpy as np
    from llmx.artifact import Artifact
    from llmx.runtime.onnx_backend import OrtBackend

    def anon_mb():
        with open("/proc/self/smaps_rollup") as f:
            return sum(int(l.split()[1]) for l in f if l.startswith("Pss_Anon:")) / 1024

    before = anon_mb()
    mode = sys.argv[2]  # "eager": both sessions packed; "lazy": the default; "low": --low-memory
    backend = OrtBackend(Artifact.open(sys.argv[1]), threads=1, low_memory=mode == "low",
                         lazy_prefill=mode != "eager")
    cache = backend.new_cache(1, 16)
    backend.prefill(cache, [0], [[1, 5, 9, 14]])
    backend.decode(cache, np.array([[7]]))
    print(json.dumps({"anon_mb": anon_mb() - before}))
""")


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="reads Linux's per-process memory accounting")
def test_weights_are_shared_not_copied_per_graph(tmp_path):
    from llmx.export import export_checkpoint

    # Big enough (about 55 MB of fp32 weights) that the weights dominate the process's own memory.
    ckpt = make_checkpoint(tmp_path / "ckpt", "llama", hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                           num_attention_heads=8, num_key_value_heads=8)
    art = tmp_path / "art"
    export_checkpoint(ckpt, art)
    weights_mb = (art / "weights.bin").stat().st_size / 2**20
    anon = {}
    for mode in ("eager", "lazy", "low"):
        out = subprocess.run([sys.executable, "-c", _MEMORY, str(art), mode], capture_output=True, text=True, check=True)
        anon[mode] = json.loads(out.stdout.splitlines()[-1])["anon_mb"]
    # Both sessions packed: a private copy per graph. The default (one prompt prefilled on the
    # decode session): one copy. Low memory: the mapped file only.
    assert anon["eager"] > 1.5 * weights_mb, (anon, weights_mb)
    assert 0.8 * weights_mb < anon["lazy"] < 1.4 * weights_mb, (anon, weights_mb)
    assert anon["low"] < 0.3 * weights_mb, (anon, weights_mb)


def test_server_loads_its_engine_in_low_memory_mode(llama_artifact):
    from llmx.serve.service import build_service

    with pytest.raises(InputError, match="--low-memory applies to --backend ort-cpu"):
        build_service(llama_artifact, backend="ort-cuda", low_memory=True)
    service = build_service(llama_artifact, threads=1, low_memory=True, prefix_cache_mb=0)
    try:
        service.wait_loaded()
        assert service.engine().backend.low_memory is True
    finally:
        service.scheduler.stop()


_TRUNCATE = textwrap.dedent("""
    import os, sys
    import numpy as np
    from llmx.artifact import Artifact
    from llmx.runtime.onnx_backend import OrtBackend
    from llmx.errors import ArtifactError

    art = sys.argv[1]
    backend = OrtBackend(Artifact.open(art), threads=1, low_memory=True)
    cache = backend.new_cache(1, 16)
    first = backend.prefill(cache, [0], [[1, 2, 3]])
    weights = os.path.join(art, "weights.bin")
    os.truncate(weights, os.path.getsize(weights) // 3)  # an artifact overwritten in place, under the server
    try:
        backend.decode(cache, np.array([[int(first[0].argmax())]]))
    except ArtifactError as exc:
        print("refused:", exc)
""")


def test_a_weights_file_truncated_under_a_low_memory_backend_is_an_error_not_sigbus(llama_artifact, tmp_path):
    copy = tmp_path / "art"
    shutil.copytree(llama_artifact, copy)
    proc = subprocess.run([sys.executable, "-c", _TRUNCATE, str(copy)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-500:])  # -7 is SIGBUS
    assert "refused: weights.bin changed size under --low-memory" in proc.stdout


def test_a_truncated_weights_file_is_refused_at_load(llama_artifact, tmp_path):
    copy = tmp_path / "art"
    shutil.copytree(llama_artifact, copy)
    os.truncate(copy / "weights.bin", (copy / "weights.bin").stat().st_size // 2)
    with pytest.raises(ArtifactError, match="out of bounds"):
        _backend(copy, low_memory=True)
