"""Turning per-round engine reports into the comparison table, JSON and plot.

Ratios are computed within each round (engine vs the baseline measured minutes apart, under
the same background load) and the median over rounds is reported; absolute numbers are the
medians over rounds of each round's median-of-runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

LABELS = {
    "llmx": "llmx (optimized, fp32)",
    "llmx-portable": "llmx (portable export, fp32)",
    "genai": "onnxruntime-genai (fp32)",
    "transformers": "transformers eager (fp32)",
    "llamacpp": "llama.cpp (f32)",
}


def _median(values) -> float:
    return float(np.median(values))


def summarize(results: dict[str, list[dict]], baseline: str) -> dict[str, dict]:
    base = results.get(baseline, [])
    summary = {}
    for engine, rounds in results.items():
        row = {k: _median([r[k] for r in rounds]) for k in
               ("decode_tokens_per_s", "ttft_ms", "tpot_ms", "tpot_p50_ms", "tpot_p90_ms", "prefill_tokens_per_s", "peak_rss_mb")}
        if base:
            pairs = list(zip(rounds, base))
            row["decode_vs_baseline"] = _median([r["decode_tokens_per_s"] / b["decode_tokens_per_s"] for r, b in pairs])
            row["ttft_vs_baseline"] = _median([r["ttft_ms"] / b["ttft_ms"] for r, b in pairs])
            row["decode_vs_baseline_per_round"] = [round(r["decode_tokens_per_s"] / b["decode_tokens_per_s"], 3) for r, b in pairs]
            row["ttft_vs_baseline_per_round"] = [round(r["ttft_ms"] / b["ttft_ms"], 3) for r, b in pairs]
        sweep = next((r["decode_step_ms_by_context"] for r in rounds if "decode_step_ms_by_context" in r), None)
        if sweep:
            contexts = sorted(sweep, key=int)
            row["decode_step_ms_by_context"] = {c: sweep[c] for c in contexts}
            row["step_ratio_last_vs_first"] = sweep[contexts[-1]] / sweep[contexts[0]]
        reference = results.get("transformers", [{}])[0].get("token_ids")
        mine = rounds[0].get("token_ids")
        if reference and mine:
            row["tokens_matching_transformers"] = next((i for i, (a, b) in enumerate(zip(mine, reference)) if a != b),
                                                       min(len(mine), len(reference)))
        summary[engine] = row
    return summary


def markdown(summary: dict[str, dict], meta: dict) -> str:
    contexts = meta["contexts"]
    first, last = str(contexts[0]), str(contexts[-1])
    lines = [
        f"SmolLM-135M shape ({meta['model']['num_hidden_layers']} layers, hidden {meta['model']['hidden_size']}, "
        f"vocab {meta['model']['vocab_size']}), prompt {meta['prompt_len']}, {meta['new_tokens']} new tokens, batch 1, "
        f"greedy. {meta['rounds']} rounds x {meta['repeat']} runs, medians; ratios within each round, then median. "
        f"{meta['date']}, load avg at end {meta['load_avg_1m_at_end']}.",
        "",
        f"| engine | decode tok/s | decode x genai | TTFT ms | TTFT x genai | TPOT p50 / p90 ms | prefill tok/s | "
        f"peak RSS MB | step {last} / step {first} | greedy tokens = transformers |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for engine, row in summary.items():
        ratio = row.get("step_ratio_last_vs_first")
        ratio = "-" if ratio is None else f"{ratio:.2f}"
        same = row.get("tokens_matching_transformers")
        same = "-" if same is None else f"{same}/{meta['new_tokens']}"
        lines.append(
            f"| {LABELS.get(engine, engine)} | {row['decode_tokens_per_s']:.1f} | {row.get('decode_vs_baseline', 0):.2f} | "
            f"{row['ttft_ms']:.0f} | {row.get('ttft_vs_baseline', 0):.2f} | {row['tpot_p50_ms']:.1f} / {row['tpot_p90_ms']:.1f} | "
            f"{row['prefill_tokens_per_s']:.0f} | {row['peak_rss_mb']:.0f} | "
            f"{ratio} | {same} |"
        )
    return "\n".join(lines) + "\n"


def plot(summary: dict[str, dict], meta: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for engine, row in summary.items():
        sweep = row.get("decode_step_ms_by_context")
        if not sweep:
            continue
        xs = [int(c) for c in sweep]
        ax.plot(xs, [1000 / ms for ms in sweep.values()], marker="o",
                label=f"{LABELS.get(engine, engine)} (step {xs[-1]}/{xs[0]}: {row['step_ratio_last_vs_first']:.2f}x)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens in the KV cache)")
    ax.set_ylabel("decode tokens/s (batch 1)")
    ax.set_title("Decode speed vs context, SmolLM-135M shape, fp32, 2-core CPU")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(results: dict[str, list[dict]], meta: dict, out: Path) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"cpu_{meta['date'].replace(' ', '_').replace(':', '')}"
    summary = summarize(results, meta["baseline"])
    paths = {"json": stem.with_suffix(".json"), "md": stem.with_suffix(".md"), "png": stem.with_suffix(".png")}
    paths["json"].write_text(json.dumps({"meta": meta, "summary": summary, "raw": results}, indent=1))
    paths["md"].write_text(markdown(summary, meta))
    plot(summary, meta, paths["png"])
    return paths
