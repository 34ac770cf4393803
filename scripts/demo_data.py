"""The demo model's data split, shared by its training script and its evaluation (no torch).

    python scripts/demo_data.py --held-out DIR   # copy the held-out stdlib files into DIR

The demo model trained on the running CPython's stdlib ``.py`` files; a file is held out when
a hash of its path says so (not a random draw, so the split does not depend on which files
exist). ``llmx eval llmx/demo_model-artifact --data DIR --seq-len 512`` then reproduces the
held-out perplexity in the model card.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import sysconfig
from pathlib import Path

# Not ordinary code: tests, IDLE, installed packages, charmap tables, pydoc's topic dump.
EXCLUDED_DIRS = {"test", "tests", "idle_test", "idlelib", "site-packages", "encodings", "pydoc_data", "__pycache__"}
HELD_OUT_PERCENT = 4


def stdlib_files() -> tuple[Path, list[str], list[str]]:
    """(stdlib root, training files, held-out files) as sorted posix paths relative to the root."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, held = [], []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        parts = rel.split("/")
        if EXCLUDED_DIRS & set(parts[:-1]) or parts[0].startswith("config-") or parts[-1].startswith("_sysconfigdata"):
            continue
        held_out = int(hashlib.sha256(rel.encode()).hexdigest(), 16) % 100 < HELD_OUT_PERCENT
        (held if held_out else train).append(rel)
    return root, train, held


def copy_held_out(out: Path) -> list[str]:
    root, _, held = stdlib_files()
    for rel in held:
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(root / rel, out / rel)
    return held


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--held-out", type=Path, required=True, help="directory to copy the held-out files into")
    args = ap.parse_args()
    print(f"copied {len(copy_held_out(args.held_out))} held-out files into {args.held_out}")
