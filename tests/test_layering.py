"""Architecture rules as tests: stages import only earlier stages; runtime and serve run without torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Pipeline order. A module may import llmx.<stage> only from its own or an earlier stage.
ORDER = ["core", "export", "optimize", "runtime", "calibration", "serve"]
FOLDERS = {"core": "llmx", "export": "export", "optimize": "optimize", "runtime": "runtime",
           "calibration": "calibration", "serve": "serve"}
TORCH_FREE = ("runtime", "serve")


def llmx_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def stage_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "llmx":
        return None
    return parts[1] if len(parts) > 1 and parts[1] in ORDER else "core"


@pytest.mark.parametrize("stage", ORDER)
def test_stages_never_import_a_later_stage(stage):
    folder = ROOT / FOLDERS[stage]
    bad = []
    for path in folder.rglob("*.py"):
        if stage == "core" and ("commands" in path.parts or path.name == "cli.py"):
            continue  # the CLI sits on top of every stage and imports them lazily
        for module in llmx_imports(path):
            other = stage_of(module)
            if other and ORDER.index(other) > ORDER.index(stage):
                bad.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not bad, bad


@pytest.mark.parametrize("stage", TORCH_FREE)
def test_torch_free_stages_import_nothing_from_torch_at_module_level(stage):
    for path in (ROOT / FOLDERS[stage]).rglob("*.py"):
        for module in llmx_imports(path):
            assert module.split(".")[0] not in ("torch", "transformers"), f"{path} imports {module}"
            assert stage_of(module) != "export", f"{path} imports {module}"


BLOCK_TORCH = """
import sys, importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('torch', 'transformers', 'safetensors'):
            raise ImportError('blocked for this test: ' + name)
sys.meta_path.insert(0, Block())
"""


def test_runtime_and_serve_modules_import_with_torch_blocked():
    code = BLOCK_TORCH + """
import pkgutil, importlib, llmx.runtime, llmx.serve, llmx.cli
for pkg in (llmx.runtime, llmx.serve):
    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name in ('tensorrt_backend',):
            continue  # imports tensorrt lazily; checked in its own tests
        importlib.import_module(pkg.__name__ + '.' + info.name)
print('ok')
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_generate_runs_end_to_end_with_torch_blocked(llama_artifact):
    code = BLOCK_TORCH + f"""
from llmx.cli import main
main(['generate', {str(llama_artifact)!r}, 'def', '--max-new-tokens', '5', '--json'])
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert '"completion_tokens": 5' in proc.stdout
