"""Turning per-round engine reports into the comparison table, JSON and plot.

Ratios are computed within each round (engine vs the baseline measured minutes apart, under
the same background load) and the median over rounds is reported; absolute numbers are the
medians over rounds of each round's median-of-runs. Every engine is compared with genai fp32
(the baseline) and, where the run has it, with the genai build of its own precision (llmx w8
with genai int8, w4 with int4).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

LABELS = {
    "llmx": "llmx (optimized, fp32)",
    "llmx-portable": "llmx (portable export, fp32)",
    "llmx-spin": "llmx (optimized, fp32, spinning on)",
    "llmx-nospin": "llmx (optimized, fp32, spinning off)",
    "genai": "onnxruntime-genai (fp32)",
    "genai-1t": "onnxruntime-genai (fp32, 1 thread)",
    "genai-2t": "onnxruntime-genai (fp32, 2 threads)",
    "transformers": "transformers eager (fp32)",
    "llamacpp": "llama.cpp (f32)",
    "llamacpp-2t": "llama.cpp (f32, 2 threads)",
    "llmx-w8": "llmx w8 (optimized, calibrate w8)",
    "llmx-w8-portable": "llmx w8 (portable export, calibrate w8)",
    "llmx-lowmem": "llmx (optimized, fp32, --low-memory)",
    "llmx-w8-spin": "llmx w8 (optimized, spinning on)",
    "llmx-w8-1t": "llmx w8 (optimized, 1 thread)",
    "llmx-w4-1t": "llmx w4 (optimized, 1 thread)",
    "llmx-w4": "llmx w4 (optimized, calibrate w4)",
    "llmx-w4-portable": "llmx w4 (portable export, calibrate w4)",
    "genai-int8": "onnxruntime-genai (int8)",
    "genai-int8-2t": "onnxruntime-genai (int8, 2 threads)",
    "genai-int4": "onnxruntime-genai (int4)",
    "genai-int4-2t": "onnxruntime-genai (int4, 2 threads)",
    "llamacpp-q8": "llama.cpp (Q8_0)",
    "llamacpp-q4": "llama.cpp (Q4_0)",
}


def _median(values) -> float:
    return float(np.median(values))


def run_metrics(run: dict) -> dict:
    steps = run["steps_s"]
    return {"ttft_ms": run["ttft_s"] * 1e3, "tpot_ms": float(np.mean(steps)) * 1e3, "decode_tokens_per_s": len(steps) / sum(steps)}


def _ratios(runs: list[dict], base: list[dict]) -> dict:
    """Decode and TTFT ratios to ``base``, run by run (same round), and their medians."""
    decode = [m["decode_tokens_per_s"] / b["decode_tokens_per_s"] for m, b in zip(runs, base)]
    ttft = [m["ttft_ms"] / b["ttft_ms"] for m, b in zip(runs, base)]
    return {"decode_by_round": decode, "ttft_by_round": ttft, "decode": _median(decode), "ttft": _median(ttft)}


def summarize(results: dict[str, dict], baseline: str, prompt_len: int,
              same_precision: dict[str, str] | None = None) -> dict[str, dict]:
    """Per engine: medians over runs, ratios to ``baseline`` (and to ``same_precision[engine]``)
    taken run by run (same round), context sweep."""
    metrics = {e: [run_metrics(r) for r in res["runs"]] for e, res in results.items()}
    reference = results.get("transformers", {}).get("runs", [{}])[0].get("token_ids")
    summary = {}
    for engine, res in results.items():
        runs, steps = metrics[engine], np.concatenate([r["steps_s"] for r in res["runs"]]) * 1e3
        row = {k: _median([m[k] for m in runs]) for k in ("ttft_ms", "tpot_ms", "decode_tokens_per_s")}
        row.update(tpot_p50_ms=float(np.percentile(steps, 50)), tpot_p90_ms=float(np.percentile(steps, 90)),
                   prefill_tokens_per_s=prompt_len / (row["ttft_ms"] / 1e3), peak_rss_mb=res["peak_rss_mb"],
                   pss_mb=res.get("pss_mb"),
                   load_s=res["load_s"], runs=len(runs))
        if baseline in metrics:
            r = _ratios(runs, metrics[baseline])
            row.update(decode_x_baseline_by_round=r["decode_by_round"], ttft_x_baseline_by_round=r["ttft_by_round"],
                       decode_x_baseline=r["decode"], ttft_x_baseline=r["ttft"])
        twin = (same_precision or {}).get(engine)
        if twin in metrics:
            r = _ratios(runs, metrics[twin])
            row.update(same_precision_baseline=twin, decode_x_same_precision_by_round=r["decode_by_round"],
                       ttft_x_same_precision_by_round=r["ttft_by_round"], decode_x_same_precision=r["decode"],
                       ttft_x_same_precision=r["ttft"])
        if res.get("sweep"):
            sweep = {c: res["sweep"][c] for c in sorted(res["sweep"], key=int)}
            row["decode_step_ms_by_context"] = sweep
            row["step_ratio_last_vs_first"] = list(sweep.values())[-1] / list(sweep.values())[0]
        mine = res["runs"][0]["token_ids"]
        if reference:
            row["tokens_matching_transformers"] = next(
                (i for i, (a, b) in enumerate(zip(mine, reference)) if a != b), min(len(mine), len(reference)))
        summary[engine] = row
    return summary


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _table(summary: dict[str, dict], meta: dict) -> list[str]:
    first, last = str(meta["contexts"][0]), str(meta["contexts"][-1])
    precision = meta.get("precision", {})
    twins = any("same_precision_baseline" in row for row in summary.values())
    twin_head = "decode x genai same precision | TTFT x genai same precision | " if twins else ""
    header = (f"| engine | decode tok/s | {twin_head}decode x genai fp32 | TTFT ms | TTFT x genai fp32 | TPOT p50 / p90 ms | "
              f"prefill tok/s | peak RSS MB | PSS MB | step {last} / step {first} | greedy tokens = transformers |")
    lines = [header, "|---|" + "---:|" * (header.count("|") - 2)]
    for engine, row in summary.items():
        same = row.get("tokens_matching_transformers")
        # Quantized weights change random-weight argmaxes within a few tokens: only fp32 rows compare.
        same = "-" if same is None or precision.get(engine, "fp32") != "fp32" else f"{same}/{meta['new_tokens']}"
        twin_cells = (f"{_fmt(row.get('decode_x_same_precision'), '.2f')} | "
                      f"{_fmt(row.get('ttft_x_same_precision'), '.2f')} | ") if twins else ""
        lines.append(
            f"| {LABELS.get(engine, engine)} | {row['decode_tokens_per_s']:.1f} | {twin_cells}"
            f"{_fmt(row.get('decode_x_baseline'), '.2f')} | {row['ttft_ms']:.0f} | {_fmt(row.get('ttft_x_baseline'), '.2f')} | "
            f"{row['tpot_p50_ms']:.1f} / {row['tpot_p90_ms']:.1f} | {row['prefill_tokens_per_s']:.0f} | "
            f"{row['peak_rss_mb']:.0f} | {_fmt(row.get('pss_mb'), '.0f')} | {_fmt(row.get('step_ratio_last_vs_first'), '.2f')} | "
            f"{same} |"
        )
    return lines


def _notes(summary: dict[str, dict], meta: dict) -> list[str]:
    """Per-round ratios of the quantized llmx rows, calibrate's quality report, the llmx bench line."""
    lines = []
    for engine, row in summary.items():
        twin = row.get("same_precision_baseline")
        if engine.startswith("llmx") and twin and twin != meta["baseline"]:
            rounds = ", ".join(f"{r:.2f}" for r in row["decode_x_same_precision_by_round"])
            lines.append(f"- {engine} / {twin} decode, per round: {rounds} (median **{row['decode_x_same_precision']:.2f}**)")
    for engine, q in meta.get("llmx_quality", {}).items():
        size = q["graph_bytes"]["decode"] / 2**20
        lines.append(f"- {engine} quality (`llmx calibrate`, {q['tokens']} held-out tokens of {meta['calibration_data']}): "
                     f"perplexity x{q['perplexity_ratio']:.4f} of fp32, top-1 agreement {q['top1_agreement']:.2%}, "
                     f"mean KL {q['mean_kl']:.5f}; decode graph {size:.0f} MiB "
                     f"(fp32 {q['fp32_graph_bytes']['decode'] / 2**20:.0f} MiB)")
    lines = ["", *lines] if lines else []
    cli = meta.get("llmx_bench_cli")
    if cli:
        lines += ["", f"`{cli['command']}` (alone, after the table): TTFT {cli['ttft_ms']:.0f} ms, TPOT {cli['tpot_ms']:.1f} ms "
                  f"(p50 {cli['tpot_p50_ms']:.1f}, p90 {cli['tpot_p90_ms']:.1f}), decode {cli['decode_tokens_per_s']:.1f} tok/s, "
                  f"prefill {cli['prefill_tokens_per_s']:.0f} tok/s, peak RSS {cli['peak_rss_mb']:.0f} MB."]
    return lines


def markdown(summary: dict[str, dict], meta: dict) -> str:
    lines = [
        f"SmolLM-135M shape ({meta['model']['num_hidden_layers']} layers, hidden {meta['model']['hidden_size']}, "
        f"vocab {meta['model']['vocab_size']}), prompt {meta['prompt_len']}, {meta['new_tokens']} new tokens, batch 1, "
        f"greedy. Engines loaded side by side, taking turns run by run: {meta['rounds']} runs each after a warm-up; "
        f"medians; ratios to onnxruntime-genai (fp32, and the genai build of the row's own precision) taken within "
        f"each round, then the median. {meta['date']}, "
        f"1-min load average {meta['load_avg_1m_at_start']} at start, {meta['load_avg_1m_at_end']} at end.",
        "",
        *_table(summary, meta),
        *_notes(summary, meta),
    ]
    return "\n".join(lines) + "\n"


def plot(summary: dict[str, dict], meta: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 4.8))
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
    ax.set_title(f"Decode speed vs context, SmolLM-135M shape, {meta['cpus']}-core CPU")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(results: dict[str, list[dict]], meta: dict, out: Path) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"cpu_{meta['date'].replace(' ', '_').replace(':', '')}"
    summary = summarize(results, meta["baseline"], meta["prompt_len"], meta.get("same_precision_baseline"))
    paths = {"json": stem.with_suffix(".json"), "md": stem.with_suffix(".md"), "png": stem.with_suffix(".png")}
    paths["json"].write_text(json.dumps({"meta": meta, "summary": summary, "raw": results}, indent=1))
    paths["md"].write_text(markdown(summary, meta))
    plot(summary, meta, paths["png"])
    return paths


if __name__ == "__main__":
    import sys

    # Re-render a saved run: python benchmarks/report.py benchmarks/results/cpu_<date>.json
    saved = json.loads(Path(sys.argv[1]).read_text())
    print(write_report(saved["raw"], saved["meta"], Path(sys.argv[1]).parent)["md"].read_text())
