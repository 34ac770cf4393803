"""docs/artifact.md is generated from the section classes: it must match them (and so cannot drift)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import artifact_doc  # noqa: E402


def test_docs_artifact_md_is_current():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "artifact_doc.py"), "--check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_every_field_of_every_section_is_described():
    text = (ROOT / "docs" / "artifact.md").read_text()
    for where, cls, *_ in artifact_doc.SECTIONS:
        body = text.split(f"## `{where}`", 1)[1].split("\n## ", 1)[0]
        for f in dataclasses.fields(cls):
            if f.name != getattr(cls, "__json_rest__", None):
                assert f"| `{f.name}` |" in body, f"{where}.{f.name} missing from docs/artifact.md"
