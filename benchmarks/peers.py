"""Building the peers' models from the benchmark checkpoint (each with the peer's own tools).

onnxruntime-genai: its model builder (``python -m onnxruntime_genai.models.builder``), CPU,
fp32, int8 or int4 (its own weight-only MatMulNBits quantization, builder defaults).
llama.cpp: the ``convert_hf_to_gguf.py`` that ships inside the installed llama-cpp-python's
source distribution (same llama.cpp version as the library), f32; Q8_0 and Q4_0 are quantized
from that f32 GGUF by llama.cpp's own ``llama_model_quantize`` (``gguf_quantize.py``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PEERS_PYTHON = HERE / ".peers-venv" / "bin" / "python"


def start_neighbour() -> subprocess.Popen:
    """A process that keeps one core busy: what a busy host looks like to the engines."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def has_module(name: str) -> bool:
    if not PEERS_PYTHON.is_file():
        return False
    return subprocess.run([str(PEERS_PYTHON), "-c", f"import {name}"], capture_output=True).returncode == 0


def _peers(args: list[str], log, cwd: Path | None = None) -> None:
    # PEERS_PYTHONPATH: packages a peers venv lacks, installed with `pip install --target DIR`
    # (a venv built before onnx-ir joined peers-requirements.txt).
    env = dict(os.environ, PYTHONPATH=os.environ["PEERS_PYTHONPATH"]) if os.environ.get("PEERS_PYTHONPATH") else None
    out = subprocess.run([str(PEERS_PYTHON), *args], capture_output=True, text=True, cwd=cwd, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:3])} failed:\n{out.stderr[-3000:]}")


def build_genai(ckpt: Path, out: Path, log, precision: str = "fp32") -> Path:
    if (out / "genai_config.json").is_file():
        return out
    log(f"onnxruntime-genai model builder ({precision}, cpu)")
    with tempfile.TemporaryDirectory() as cache:
        # cwd: `python -m` puts it first on sys.path, where benchmarks/quantization.py would
        # shadow the builder's own `quantization` package.
        _peers(["-m", "onnxruntime_genai.models.builder", "-i", str(ckpt), "-o", str(out), "-p", precision, "-e", "cpu",
                "-c", cache], log, cwd=Path(cache))
    return out


def _llama_cpp_sources(cache: Path, log) -> Path:
    """vendor/llama.cpp of the installed llama-cpp-python's sdist (convert script, conversion/, gguf-py/)."""
    version = subprocess.run([str(PEERS_PYTHON), "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                             capture_output=True, text=True, check=True).stdout.strip()
    root = cache / f"llama-cpp-python-{version}"
    src = root / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    if (src / "convert_hf_to_gguf.py").is_file():
        return src
    log(f"fetching llama-cpp-python {version} sources for its GGUF converter")
    _peers(["-m", "pip", "download", "-q", f"llama-cpp-python=={version}", "--no-deps", "--no-binary", ":all:",
            "-d", str(root)], log)
    wanted = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
    with tarfile.open(next(root.glob("*.tar.gz"))) as tar:
        members = [m for m in tar.getmembers() if any(f"vendor/llama.cpp/{w}" in m.name for w in wanted)]
        tar.extractall(root, members=members, filter="data")
    return src


def build_gguf(ckpt: Path, out: Path, log) -> Path:
    if out.is_file():
        return out
    src = _llama_cpp_sources(out.parent, log)
    log("llama.cpp convert_hf_to_gguf (f32)")
    tmp = out.with_suffix(".tmp")
    _peers([str(HERE / "gguf_convert.py"), str(src), str(ckpt), str(tmp)], log)
    shutil.move(tmp, out)
    return out


def quantize_gguf(f32: Path, out: Path, ftype: str, log) -> Path:
    """``ftype`` (q8_0, q4_0) from the f32 GGUF with llama.cpp's own quantizer, llama.cpp's defaults."""
    if out.is_file():
        return out
    log(f"llama.cpp quantize ({ftype})")
    tmp = out.with_suffix(".tmp")
    _peers([str(HERE / "gguf_quantize.py"), str(f32), str(tmp), ftype], log)
    shutil.move(tmp, out)
    return out
