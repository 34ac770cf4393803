"""The demo model's data split, shared by its training script and its evaluation (no torch).

    python scripts/demo_data.py --held-out DIR   # copy the held-out stdlib files into DIR
    python scripts/demo_data.py --calib FILE     # write a calibration text from training files
    python scripts/demo_data.py --held-out heldout --calib calib.txt   # the README tour's inputs

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


CALIB_BYTES = 256 << 10  # plenty for calibration windows of the demo model, a second to read


def write_calibration_text(out: Path, limit: int = CALIB_BYTES) -> int:
    """Training files (never held-out ones) concatenated into one text file of about ``limit``
    bytes, spread over the stdlib rather than its first package; returns the files used."""
    root, train, _ = stdlib_files()
    step = max(1, len(train) // 200)
    parts, size = [], 0
    for rel in train[::step]:
        text = (root / rel).read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        size += len(text.encode())
        if size >= limit:
            break
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n\n".join(parts), encoding="utf-8")
    return len(parts)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--held-out", type=Path, help="directory to copy the held-out files into")
    ap.add_argument("--calib", type=Path, help="text file to write calibration data into")
    args = ap.parse_args()
    if args.held_out is None and args.calib is None:
        ap.error("give --held-out DIR, --calib FILE or both")
    if args.held_out is not None:
        print(f"copied {len(copy_held_out(args.held_out))} held-out files into {args.held_out}")
    if args.calib is not None:
        print(f"wrote {args.calib} from {write_calibration_text(args.calib)} training files")
