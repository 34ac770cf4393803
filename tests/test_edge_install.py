"""The edge install: `pip install 'llmx[cpu,serve]'` (no torch, no transformers, no onnx) serves
and generates from exported artifacts. Runs in a fresh virtual environment."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import requests

from llmx.runtime.embed import Embedder

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def edge_venv(tmp_path_factory) -> Path:
    venv = tmp_path_factory.mktemp("edge") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "-c", str(ROOT / "constraints.txt"),
                    f"{ROOT}[cpu,serve]"], check=True, timeout=1200)
    return venv


def run(venv: Path, *args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([str(venv / "bin" / args[0]), *args[1:]], capture_output=True, text=True, timeout=300, **kwargs)


def test_edge_install_has_no_torch_transformers_or_onnx(edge_venv):
    for module in ("torch", "transformers", "onnx", "safetensors"):
        proc = run(edge_venv, "python", "-c", f"import {module}")
        assert proc.returncode != 0 and "ModuleNotFoundError" in proc.stderr, module


def test_edge_install_generates(edge_venv, llama_artifact):
    proc = run(edge_venv, "llmx", "generate", str(llama_artifact), "def", "--max-new-tokens", "6", "--temperature", "0", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["completion_tokens"] == 6


def test_edge_install_serves_embeddings(edge_venv, minilm_artifact):
    server = subprocess.Popen([str(edge_venv / "bin" / "llmx"), "serve", str(minilm_artifact), "--port", "0", "--threads", "1"],
                              stderr=subprocess.PIPE, text=True)
    try:
        url = None
        deadline = time.time() + 120
        while time.time() < deadline and url is None:
            line = server.stderr.readline()
            if match := re.search(r"on (http://\S+)/v1", line):
                url = match.group(1)
            assert line or server.poll() is None, "server exited"
        assert url, "server did not start"
        texts = ["an edge box embeds this", "and this too"]
        body = requests.post(url + "/v1/embeddings", json={"input": texts, "encoding_format": "float"}, timeout=60).json()
        got = np.array([d["embedding"] for d in body["data"]], np.float32)
        want = Embedder.load(minilm_artifact, threads=1).embed(texts).vectors
        np.testing.assert_allclose(got, want, atol=1e-6)
    finally:
        server.terminate()
        server.wait(30)
