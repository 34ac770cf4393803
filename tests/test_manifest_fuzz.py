"""An artifact is untrusted input: corrupt manifests must end in one error line, never a traceback
and never a read outside the artifact.

Hypothesis mutates valid manifests (an exported decoder and a TensorRT-built one): type swaps,
nulls, lists for objects, huge numbers, ``..`` and absolute paths, symlinks that lead out. Which
fields exist and what type each has is read from the section dataclasses, so fields added later
are fuzzed too. Each case runs a command in-process: ``inspect``, ``generate``, ``serve`` start-up
(the server never starts: loading fails first) and ``calibrate``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import shutil
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fake_gpu import FakeBuilder
from llmx.cli import main
from llmx.engine.tensorrt import build_artifact, plan_build
from llmx.artifact.tensorrt import BuildLimits
from llmx.artifact.manifest import MANIFEST_NAME, Manifest
from llmx.artifact.schema import ArtifactPath, hints

COMMANDS = {
    "inspect": lambda art, tmp: ["inspect", str(art)],
    "generate": lambda art, tmp: ["generate", str(art), "hi", "--max-new-tokens", "2"],
    "serve": lambda art, tmp: ["serve", str(art), "--port", "0"],
    "calibrate": lambda art, tmp: ["calibrate", str(art), "--data", str(tmp / "calib.txt"), "--scheme", "w8",
                                   "-o", str(tmp / "out")],
}
EXAMPLES_PER_COMMAND = 130  # x 4 commands: 520 cases


@dataclasses.dataclass(frozen=True)
class Slot:
    """One typed place in the manifest: its JSON path, its declared type, whether it is a dict key."""

    path: tuple
    tp: Any
    key: bool = False


def typed_slots(tp: Any, value: Any, path: tuple = ()) -> list[Slot]:
    """Every place in ``value`` whose declared type says which values are wrong (Any is skipped)."""
    if tp is Any:
        return []
    slots = [Slot(path, tp)]
    base = _non_null(tp)
    origin = typing.get_origin(base)
    if dataclasses.is_dataclass(base) and isinstance(value, dict):
        rest = getattr(base, "__json_rest__", None)
        for f in dataclasses.fields(base):
            if f.name in value and f.name != rest:
                tp = hints(base)[f.name]
                tp = tp | None if f.default is None else tp  # null is a field's valid default, however annotated
                slots += typed_slots(tp, value[f.name], (*path, f.name))
    elif origin is list and isinstance(value, list):
        for i, item in enumerate(value):
            slots += typed_slots(typing.get_args(base)[0], item, (*path, i))
    elif origin is dict and isinstance(value, dict):
        key_tp, value_tp = typing.get_args(base)
        for k, item in value.items():
            if key_tp is ArtifactPath:
                slots.append(Slot((*path, k), ArtifactPath, key=True))
            slots += typed_slots(value_tp, item, (*path, k))
    return slots


def _non_null(tp: Any) -> Any:
    if typing.get_origin(tp) in (Union, types.UnionType):
        options = [a for a in typing.get_args(tp) if a is not type(None)]
        return options[0] if len(options) == 1 else tp
    return tp


def _nullable(tp: Any) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType) and type(None) in typing.get_args(tp)


def _kinds(tp: Any) -> set[str]:
    """JSON kinds a type accepts: int, float, str, bool, list, object."""
    base, origin = _non_null(tp), typing.get_origin(_non_null(tp))
    if origin in (Union, types.UnionType):
        return set().union(*(_kinds(a) for a in typing.get_args(base) if a is not type(None)))
    if base is int:
        return {"int"}
    if base is float:
        return {"int", "float"}
    if base in (str, ArtifactPath) or origin is Literal:
        return {"str"}
    if base is bool:
        return {"bool"}
    if base is list or origin is list:
        return {"list"}
    return {"object"}


WRONG_VALUES = {
    "int": st.integers(-1000, 1000),
    "float": st.floats(-1e6, 1e6, allow_nan=False).filter(lambda x: not x.is_integer()),
    "str": st.text(max_size=12),
    "bool": st.booleans(),
    "list": st.lists(st.integers(0, 9), max_size=3),  # a list where an object belongs, and more
    "object": st.dictionaries(st.sampled_from(["a", "file", "0"]), st.integers(0, 9), max_size=2),
}
HUGE = st.one_of(st.integers(min_value=2**53 + 1, max_value=10**40), st.integers(min_value=-(10**40), max_value=-(2**53) - 1))
BAD_PATHS = st.sampled_from(["../outside/secret.txt", "/etc/hostname", "tokenizer/../../outside/secret.txt",
                             "../../../../etc/hostname", "", "C:/Windows/win.ini", "a\\..\\..\\b"])


KINDS = ("swap", "null", "huge", "path", "symlink", "version", "whole")


def eligible(kind: str, slot: Slot, manifest: dict) -> bool:
    base = _non_null(slot.tp)
    if kind == "path":
        return base is ArtifactPath
    if kind == "symlink":
        return base is ArtifactPath and not slot.key and isinstance(_at(manifest, slot.path), str)
    if slot.key:
        return False
    if kind == "null":
        return bool(slot.path) and not _nullable(slot.tp)
    if kind == "huge":
        return base is int
    if kind == "version":
        return slot.path == ("schema_version",)
    if kind == "whole":
        return not slot.path
    return True  # swap


@st.composite
def mutations(draw, manifest: dict):
    """(kind, slot, value) that makes ``manifest`` invalid by its declared types; the kind is drawn
    first so that paths and symlinks get as many cases as type swaps."""
    kind = draw(st.sampled_from(KINDS))
    slot = draw(st.sampled_from([s for s in typed_slots(Manifest, manifest) if eligible(kind, s, manifest)]))
    if kind in ("null", "symlink"):
        return kind, slot, None
    if kind == "huge":
        return kind, slot, draw(HUGE)
    if kind == "path":
        return kind, slot, draw(BAD_PATHS)
    if kind == "version":
        return kind, slot, draw(st.sampled_from([0, 3, 99, "2", None, 2.5, [2]]))
    if kind == "whole":
        return kind, slot, draw(st.sampled_from([[], None, "llmx", 3, [manifest]]))
    kinds = _kinds(slot.tp)
    wrong = sorted(set(WRONG_VALUES) - kinds - ({"int"} if "float" in kinds else set()))
    return kind, slot, draw(st.sampled_from(wrong).flatmap(lambda k: WRONG_VALUES[k]))


def _at(manifest: Any, path: tuple) -> Any:
    for step in path:
        manifest = manifest[step]
    return manifest


def apply(manifest: dict, art: Path, kind: str, slot: Slot, value: Any) -> Any:
    """Mutate ``manifest`` (and ``art``) in place; returns the top-level replacement, if any."""
    if not slot.path:
        return value  # the whole manifest replaced
    parent = manifest
    for step in slot.path[:-1]:
        parent = parent[step]
    last = slot.path[-1]
    if kind == "symlink":  # the file it names becomes a symlink out of the artifact
        target = art / parent[last]
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists() or target.is_symlink():
            target.unlink()
        target.symlink_to(art.parent.parent / "outside" / "secret.txt")
    elif slot.key:
        parent[value] = parent.pop(last)
    else:
        parent[last] = value
    return manifest


@pytest.fixture(scope="module")
def sources(llama_artifact, tmp_path_factory) -> dict[str, Path]:
    """Valid artifacts to mutate: an exported decoder and one with (fake) TensorRT engines."""
    root = tmp_path_factory.mktemp("fuzz")
    built = root / "built"
    build_artifact(llama_artifact, built, plan_build(llama_artifact, "fp32", "split", BuildLimits(max_batch=2, max_seq_len=64)),
                   FakeBuilder)
    return {"exported": llama_artifact, "built": built}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cases")
    (root / "outside").mkdir()
    (root / "outside" / "secret.txt").write_text("secret: a manifest must never lead here\n")
    (root / "calib.txt").write_text("def f(x):\n    return x\n" * 50)
    return root


def fresh_copy(src: Path, dst: Path) -> None:
    """The artifact's files hardlinked (cheap; symlinks would count as leading out), manifest copied.
    The caller removes the copy right after its case: while it exists, the source's files have two links."""
    shutil.copytree(src, dst, copy_function=os.link, ignore=shutil.ignore_patterns(MANIFEST_NAME))
    shutil.copy2(src / MANIFEST_NAME, dst / MANIFEST_NAME)


def run_cli(args: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            main(args)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    return code, err.getvalue()


@pytest.fixture
def no_server(monkeypatch):
    """If a corrupt manifest ever loaded, `llmx serve` would fail the test here instead of serving."""
    import werkzeug.serving

    def refuse(*args, **kwargs):
        raise AssertionError("the corrupt manifest loaded and the server was about to start")

    monkeypatch.setattr(werkzeug.serving, "make_server", refuse)


@pytest.fixture
def reads_outside(workdir):
    """Paths under workdir/outside that Python opened (an audit hook; removed hooks are not possible,
    so it stays installed and records only while the list is the active one)."""
    seen: list[str] = []
    active["list"] = seen
    yield seen
    active["list"] = None


active: dict[str, list | None] = {"list": None}


def _audit(event: str, args: tuple) -> None:
    if event == "open" and active["list"] is not None and args and isinstance(args[0], (str, bytes, os.PathLike)):
        path = os.fsdecode(args[0])
        if path.endswith(("/outside/secret.txt", "/etc/hostname", "win.ini")):
            active["list"].append(path)


sys.addaudithook(_audit)


@pytest.mark.parametrize("command", COMMANDS)
def test_corrupt_manifests_end_in_one_error_line(command, sources, workdir, no_server, reads_outside):
    counter = iter(range(10**6))

    @settings(max_examples=EXAMPLES_PER_COMMAND, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                     HealthCheck.data_too_large, HealthCheck.filter_too_much])
    @given(data=st.data())
    def case(data):
        source = data.draw(st.sampled_from(sorted(sources)))
        manifest = json.loads((sources[source] / MANIFEST_NAME).read_text())
        kind, slot, value = data.draw(mutations(manifest))
        art = workdir / f"{command}-{next(counter)}" / "art"
        fresh_copy(sources[source], art)
        try:  # the hardlinks go at once: onnx refuses external data with several links
            mutated = apply(manifest, art, kind, slot, value)
            (art / MANIFEST_NAME).write_text(json.dumps(mutated))
            code, err = run_cli(COMMANDS[command](art, workdir))
        finally:
            shutil.rmtree(art.parent)
        where = f"{kind} at {'.'.join(map(str, slot.path)) or 'the manifest'} = {value!r} ({source})"
        lines = [line for line in err.splitlines() if line.strip()]
        assert code != 0, f"{where}: exit 0"
        assert "Traceback" not in err, f"{where}: {err}"
        assert len(lines) == 1 and lines[0].startswith(f"error: {art / MANIFEST_NAME}: "), f"{where}: {err!r}"
        assert not reads_outside, f"{where}: read {reads_outside}"

    case()


def test_the_fuzzer_reaches_every_section(sources):
    """The slots cover each section of both manifests, so the cases above can hit any of them."""
    for source in sources.values():
        manifest = json.loads((source / MANIFEST_NAME).read_text())
        tops = {s.path[0] for s in typed_slots(Manifest, manifest) if s.path}
        assert {"model", "graphs", "tokenizer", "kv", "precision", "checksums", "lineage"} <= tops
    built = json.loads((sources["built"] / MANIFEST_NAME).read_text())
    assert any(s.path[:2] == ("tensorrt", "engines") for s in typed_slots(Manifest, built))
