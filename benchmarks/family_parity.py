"""Parity of every family variant the tests build (tests/conftest.py), portable and optimized, and
with ``--speed`` the optimized-vs-portable decode speed from `llmx bench`'s loop on the tests' tiny shape.

For each variant: max |logit diff| against transformers over prefill and 16 greedy decode steps
(and that bound relative to the logit scale, max |logit|), whether a 32-token greedy
continuation equals transformers' ``generate``, and whether ``llmx optimize`` took it.
Prints a table and writes JSON (``--json``). Nothing downloads; checkpoints are tiny and random.

    .venv/bin/python benchmarks/family_parity.py --variants qwen3 gemma2 --json results/family_parity.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

PROMPT = "class Wrapper(object):\n    def __init__(self, width"


def _steps(engine, ids: list[int], n: int) -> tuple[np.ndarray, list[int]]:
    backend = engine.backend
    cache = backend.new_cache(1, len(ids) + n)
    logits = [backend.prefill(cache, [0], [ids])[0].copy()]
    tokens = list(ids)
    for _ in range(n):
        tokens.append(int(np.argmax(logits[-1])))
        logits.append(backend.decode(cache, np.array([[tokens[-1]]]))[0, 0].copy())
    return np.stack(logits), tokens


def decode_speed(art: Path) -> float:
    """Decode tokens/s of `llmx bench`'s loop (prompt 64, 64 new tokens, median of 5, 1 thread)."""
    from llmx.runtime.bench import bench
    from llmx.runtime.engine import Engine

    engine = Engine.load(art, threads=1)
    return bench(engine.backend, engine.tokenizer, 64, 64, 1, 5, 1).decode_tokens_per_s


def measure(variant: str, family: str, overrides: dict, root: Path, speed: bool) -> dict:
    import torch
    import transformers

    from checkpoints import make_checkpoint
    from llmx.errors import LlmxError
    from llmx.export import export_checkpoint
    from llmx.optimize.fuse import optimize_artifact
    from llmx.runtime.engine import Engine
    from llmx.runtime.sampling import SamplingParams

    ckpt = make_checkpoint(root / "ckpt" / variant, family, **overrides)
    portable, fused = root / "art" / variant, root / "opt" / variant
    export_checkpoint(ckpt, portable)
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt).eval()
    row = {"variant": variant, "family": family}
    try:
        optimize_artifact(portable, fused)
        arts = {"portable": portable, "optimized": fused}
        row["optimize"] = "yes"
    except LlmxError as exc:
        arts = {"portable": portable}
        row["optimize"] = f"refused: {exc}"
    for kind, art in arts.items():
        engine = Engine.load(art, threads=1)
        ids = engine.encode(PROMPT)
        ours, tokens = _steps(engine, ids, 16)
        with torch.no_grad():
            ref = model(torch.tensor([tokens])).logits[0].numpy()[len(ids) - 1:]
            short = engine.encode("import json")
            greedy_ref = model.generate(torch.tensor([short]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                                        pad_token_id=0)[0, len(short):].tolist()
        greedy = engine.generate(["import json"], SamplingParams(max_new_tokens=32, temperature=0, ignore_eos=True))[0]
        row[kind] = {"max_abs_diff": float(np.abs(ours - ref).max()), "logit_scale": float(np.abs(ref).max()),
                     "greedy_identical": greedy.output_ids == greedy_ref}
    if speed and "optimized" in arts:
        row["decode_tok_s"] = {kind: decode_speed(art) for kind, art in arts.items()}
        row["optimized_vs_portable"] = row["decode_tok_s"]["optimized"] / row["decode_tok_s"]["portable"]
    return row


def main() -> None:
    from conftest import FAMILY_VARIANTS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="*", default=list(FAMILY_VARIANTS))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--speed", action="store_true", help="also time decode, portable vs optimized")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.variants:
            family, overrides = FAMILY_VARIANTS[name]
            rows.append(measure(name, family, overrides, Path(tmp), args.speed))
    print("| variant | portable max abs diff (/ logit scale) | greedy | optimize | fused max abs diff | greedy | decode fused/portable |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        cells = [r["variant"]]
        for kind in ("portable", "optimized"):
            if kind == "optimized":
                cells.append(r["optimize"])
            m = r.get(kind)
            cells += [f"{m['max_abs_diff']:.1e} ({m['max_abs_diff'] / m['logit_scale']:.1e})",
                      "identical" if m["greedy_identical"] else "DIFFERS"] if m else ["-", "-"]
        cells.append(f"{r['optimized_vs_portable']:.2f}x" if "optimized_vs_portable" in r else "-")
        print("| " + " | ".join(cells) + " |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
