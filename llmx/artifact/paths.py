"""Files an artifact names, resolved inside its directory and nowhere else.

An artifact is downloaded and copied between machines: untrusted input. Every path its
manifest names goes through ``artifact_file`` before anything opens it, so a manifest cannot
make llmx read ``/etc/passwd`` through an absolute path, ``..`` or a symlink that leads out.
"""

from __future__ import annotations

from pathlib import Path

from llmx.errors import ArtifactError
from llmx.artifact.schema import check_relative_path, render


def artifact_file(root: str | Path, rel: str, field: str = "file") -> Path:
    """``root / rel``, refusing a path that resolves outside ``root``; ``field`` names it in errors."""
    if not isinstance(rel, str):
        raise ArtifactError(f"{field} must be a relative path inside the artifact, got {render(rel)}")
    check_relative_path(rel, field)
    path = Path(root) / rel
    try:
        real, base = path.resolve(), Path(root).resolve()
    except (OSError, RuntimeError) as exc:  # a symlink loop
        raise ArtifactError(f"{field} {render(rel)} cannot be resolved: {exc}") from exc
    if not real.is_relative_to(base):
        raise ArtifactError(f"{field} {render(rel)} is a symlink that points outside the artifact")
    return path
