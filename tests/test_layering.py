"""Architecture rules as tests: stages import only earlier stages (in the order the CLI lists them);
runtime and serve import only the core contract and runtime code, and run without torch; no two
modules import each other, directly or through others."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Pipeline order, as the CLI lists its commands. A module may import llmx.<stage> only from its
# own or an earlier stage; the core (llmx/: the manifest contract, spec, errors) is below them all.
ORDER = ["core", "export", "optimize", "calibration", "engine", "runtime", "serve"]
FOLDERS = {"core": "llmx", "export": "export", "optimize": "optimize", "calibration": "calibration",
           "engine": "engine", "runtime": "runtime", "serve": "serve"}
# The one exception: calibrate measures what quantization cost by running the quantized graphs.
EXCEPTIONS = {("calibration", "runtime")}
# What each command runs: the CLI's order of commands must be the pipeline order.
STAGE_OF_COMMAND = {"export": "export", "optimize": "optimize", "calibrate": "calibration", "build": "engine",
                    "generate": "runtime", "bench": "runtime", "eval": "runtime", "embed": "runtime", "serve": "serve"}
# Stages that run on edge boxes: the core contract and their own code only.
EDGE = {"runtime": {"core", "runtime"}, "serve": {"core", "runtime", "serve"}}
TORCH_FREE = ("runtime", "serve", "engine")


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


def stage_modules(stage: str):
    for path in (ROOT / FOLDERS[stage]).rglob("*.py"):
        if stage == "core" and ("commands" in path.parts or path.name == "cli.py"):
            continue  # the CLI sits on top of every stage and imports them lazily
        yield path


@pytest.mark.parametrize("stage", ORDER)
def test_stages_never_import_a_later_stage(stage):
    bad = []
    for path in stage_modules(stage):
        for module in llmx_imports(path):
            other = stage_of(module)
            if other and ORDER.index(other) > ORDER.index(stage) and (stage, other) not in EXCEPTIONS:
                bad.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not bad, bad


@pytest.mark.parametrize("stage", sorted(EDGE))
def test_runtime_and_serve_import_only_the_contract_and_runtime_code(stage):
    bad = [f"{path.relative_to(ROOT)} imports {module}" for path in stage_modules(stage)
           for module in llmx_imports(path) if stage_of(module) not in (None, *EDGE[stage])]
    assert not bad, bad


def test_the_cli_lists_commands_in_pipeline_order():
    from llmx.cli import COMMAND_MODULES, cli

    stages = [STAGE_OF_COMMAND[c] for c in COMMAND_MODULES if c in STAGE_OF_COMMAND]
    first_seen = list(dict.fromkeys(stages))
    assert first_seen == ORDER[1:]
    assert stages == sorted(stages, key=ORDER.index), "commands of a stage sit together, in pipeline order"
    assert "export -> optimize -> calibrate -> build -> generate / bench / serve" in cli.help


@pytest.mark.parametrize("stage", TORCH_FREE)
def test_torch_free_stages_import_nothing_from_torch_at_module_level(stage):
    for path in (ROOT / FOLDERS[stage]).rglob("*.py"):
        for module in llmx_imports(path):
            assert module.split(".")[0] not in ("torch", "transformers"), f"{path} imports {module}"
            assert stage_of(module) != "export", f"{path} imports {module}"


def blocking(*packages: str) -> str:
    """Python source that makes importing any of ``packages`` fail, as on an install without them."""
    return f"""
import sys, importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {packages!r}:
            raise ImportError('blocked for this test: ' + name)
sys.meta_path.insert(0, Block())
"""


BLOCK_TORCH = blocking("torch", "transformers", "safetensors")


def test_runtime_and_serve_modules_import_with_torch_blocked():
    code = BLOCK_TORCH + """
import pkgutil, importlib, llmx.runtime, llmx.serve, llmx.cli
import llmx.engine
for pkg in (llmx.runtime, llmx.serve, llmx.engine):
    for info in pkgutil.iter_modules(pkg.__path__):
        importlib.import_module(pkg.__name__ + '.' + info.name)
print('ok')
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_generate_runs_end_to_end_with_torch_blocked(llama_artifact):
    code = BLOCK_TORCH + f"""
from llmx.cli import main
main(['generate', {str(llama_artifact)!r}, 'def', '--max-new-tokens', '5', '--ignore-eos', '--json'])
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert '"completion_tokens": 5' in proc.stdout


def test_the_cli_offers_the_backends_the_runtime_has():
    from llmx.commands.options import BACKEND_CHOICES
    from llmx.runtime.engine import BACKENDS

    assert BACKEND_CHOICES == BACKENDS


def test_optional_dependencies_come_through_one_door():
    """tensorrt, polygraphy, ray and gguf come in through llmx.errors.require (one error line naming what
    to install); a module may import their submodules only after asking require for the package."""
    optional = ("tensorrt", "polygraphy", "ray", "gguf")
    bad = []
    for stage in ORDER:
        for path in stage_modules(stage):
            text = path.read_text()
            for module in llmx_imports(path):
                package = module.split(".")[0]
                if package in optional and f'require("{package}' not in text:
                    bad.append(f"{path.relative_to(ROOT)} imports {module} without require")
    assert not bad, bad


# --- No import loops -------------------------------------------------------------------------
# A loop closed only by an import inside a function still binds both modules together (neither can
# be read, tested or moved alone), so imports inside functions count as edges too.


def package_folders(root: Path) -> dict[str, Path]:
    """Each llmx package's folder, from pyproject's package-dir mapping (export/ -> llmx.export, ...)."""
    import tomllib

    setuptools = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapping = setuptools["package-dir"]
    folders = {}
    for package in setuptools["packages"]:
        parts = package.split(".")
        base = next(".".join(parts[:i]) for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in mapping)
        folders[package] = root / mapping[base] / Path(*parts[len(base.split(".")):])
    return folders


def module_files(folders: dict[str, Path]) -> dict[str, Path]:
    """Module name -> file for every module of the given packages (``__init__`` is the package)."""
    files = {}
    for package, folder in folders.items():
        for path in folder.glob("*.py"):
            files[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return files


def import_graph(files: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules among ``files`` it imports anywhere in its text (functions included)."""
    graph = {}
    for module, path in files.items():
        package = module if path.stem == "__init__" else module.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                # `from pkg import name`: the submodule when name is one, else the package itself
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            edges.update(t for t in targets if t in files and t != module)
        graph[module] = edges
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One loop (a -> b -> ... -> a) per strongly connected group of modules that import each other."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def connect(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while v not in group:
                group.add(stack.pop())
            on_stack.difference_update(group)
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [_loop_through(graph, group) for group in groups]


def _loop_through(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """The shortest import path from the group's first module back to itself, inside the group."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & group):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no loop through {sorted(group)}")


def test_the_cycle_check_finds_a_loop_closed_inside_a_function(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import helper\n")
    (pkg / "b.py").write_text("def helper():\n    from pkg import a\n    return a\n")
    (pkg / "c.py").write_text("from . import a\n")  # imports into the loop, not part of it
    graph = import_graph(module_files({"pkg": pkg}))
    assert graph == {"pkg": set(), "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}, "pkg.c": {"pkg.a"}}
    assert import_cycles(graph) == [["pkg.a", "pkg.b", "pkg.a"]]
    (pkg / "b.py").write_text("def helper():\n    return 1\n")
    assert import_cycles(import_graph(module_files({"pkg": pkg}))) == []


def test_the_package_folders_follow_pyproject():
    folders = package_folders(ROOT)
    assert folders["llmx.export"] == ROOT / "export" and folders["llmx.artifact"] == ROOT / "llmx" / "artifact"
    assert "llmx.calibration.search" in module_files(folders)


def test_no_module_imports_itself_through_others():
    cycles = import_cycles(import_graph(module_files(package_folders(ROOT))))
    assert not cycles, "import loops: " + "; ".join(" -> ".join(loop) for loop in cycles)


def test_calibration_imports_without_onnx():
    """``llmx eval`` (a runtime command, on edge boxes without onnx) reads text through
    llmx.calibration.data: the calibration package loads onnx and onnxruntime only when it runs."""
    code = blocking("onnx", "onnxruntime", "torch") + """
import pkgutil, importlib, llmx.calibration
for info in pkgutil.iter_modules(llmx.calibration.__path__):
    importlib.import_module('llmx.calibration.' + info.name)
print('ok')
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
