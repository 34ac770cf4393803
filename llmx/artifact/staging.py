"""Writing artifact directories atomically.

Every stage writes into a hidden temp dir beside the destination and renames it into place
only after the manifest (written last, with checksums) is there. A failure at any point
leaves no half-written artifact behind, and an existing artifact is never touched unless the
user asked to overwrite it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from llmx.errors import ArtifactError, InputError
from llmx.artifact.manifest import MANIFEST_NAME, Manifest, checksum_tree


@contextlib.contextmanager
def staged_artifact(out: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temp dir to fill; on clean exit it becomes ``out`` (which must then hold a manifest)."""
    out = Path(out).absolute()
    if out.exists() and not overwrite:
        raise InputError(f"output {out} already exists (pass --force to replace it)")
    if out.exists() and not (out / MANIFEST_NAME).is_file():
        # Refuse to delete a directory llmx did not write, even with --force.
        raise InputError(f"output {out} exists and is not an llmx artifact; refusing to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; an artifact is an ordinary directory
    try:
        yield tmp
        if not (tmp / MANIFEST_NAME).is_file():
            raise ArtifactError("internal error: stage finished without writing a manifest")
        if out.exists():
            old = out.with_name(f".{out.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def finish(directory: Path, manifest: Manifest) -> Manifest:
    """Checksum every file, then write the manifest: always the last file of an artifact."""
    manifest.checksums = checksum_tree(directory)
    manifest.save(directory)
    return manifest


def copy_tokenizer(src_artifact: Path, dst: Path) -> None:
    shutil.copytree(Path(src_artifact) / "tokenizer", dst / "tokenizer")
