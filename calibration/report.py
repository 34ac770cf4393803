"""The quality report: what quantization cost, measured on held-out text.

    perplexity (fp32 and quantized) and their ratio, top-1 next-token agreement, mean
    KL(fp32 || quantized) of next-token distributions, and each graph's size on disk

written to ``quality.json`` in the quantized artifact, recorded in its manifest and printed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterable

from llmx.artifact.handle import Artifact
from llmx.calibration.judge import kl_ratio, reference_logprobs
from llmx.calibration.on_disk import ArraysOnDisk
from llmx.calibration.search import format_search
from llmx.runtime.engine import make_backend
from llmx.runtime.evaluate import agree, agreement, window_logprobs

REPORT_FILE = "quality.json"


def measure(reference: Artifact, candidate: Artifact, windows: list[list[int]], threads: int | None = None,
            progress: Callable[[int], None] = lambda n: None, fp32_logprobs: Iterable | None = None,
            layered: bool = False) -> dict:
    """Perplexity of both artifacts and their agreement on ``windows`` (ONNX Runtime CPU).
    ``fp32_logprobs``: the fp32 side already computed, one float32 array per window (the search
    judge's, or layered_reference). ``layered``: the model's memory is short (below)."""
    # lazy_prefill=False: the report must judge the candidate's prefill graph too (a batch of
    # prompts runs it), even when a window batch holds one row, which the default would prefill on
    # the decode graph. The fp32 reference is not judged: its decode graph alone computes the same
    # function, and a second session would pack a second copy of the fp32 weights (SmolLM2: 0.6 GB).
    # A model run a layer at a time (``layered``) is one whose memory is short: the candidate's
    # prefill graph, whose session would pack a second copy of the blocks (8B w4: 4.3 GB), is
    # left out, and its decode graph prefills, as a single prompt is served.
    cand = make_backend(candidate, "ort-cpu", threads=threads, lazy_prefill=layered)
    if fp32_logprobs is None:
        ref = make_backend(reference, "ort-cpu", threads=threads, lazy_prefill=True)
        result = agreement(ref, cand, windows, progress).summary()
    else:
        result = agree(fp32_logprobs, window_logprobs(cand, windows), windows, progress).summary()
    return {
        "fp32": {"perplexity": result["reference_perplexity"], "graph_bytes": reference.graph_bytes()},
        "quantized": {"perplexity": result["perplexity"], "graph_bytes": candidate.graph_bytes()},
        "perplexity_ratio": result["perplexity_ratio"],
        "perplexity_ratio_upper": result["perplexity_ratio_upper"],
        "top1_agreement": result["top1_agreement"],
        "mean_kl": result["mean_kl"],
        "tokens": result["tokens"],
        "windows": result["windows"],
    }


def layered_reference(source: Artifact, windows: list[list[int]], threads: int | None, path: Path,
                      progress: Callable[[int], None] = lambda n: None) -> ArraysOnDisk:
    """The fp32 side of ``measure`` for a model whose fp32 graph does not fit: its decode graph a
    layer at a time over whole windows (judge.reference_logprobs), kept on disk in float32 and read
    back a window at a time while the candidate runs (both at once would hold a layer beside the
    candidate's weights)."""
    found = ArraysOnDisk(path)
    for logprobs in reference_logprobs(source.graph_path("decode"), source.manifest, windows, threads, True):
        found.append(logprobs)
        progress(1)
    return found


def write_report(directory: Path, report: dict) -> None:
    (Path(directory) / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def format_report(report: dict) -> str:
    text = _format_quality(report)
    if "search" in report:
        met = "meets" if report["meets_target"] else "MISSES"
        text += (f"\n{format_search(report['search'])}\n  the artifact {met} the target; "
                 f"calibration took {report['calibration_seconds']:.0f} s")
    return text


def _format_quality(report: dict) -> str:
    ev, fp, q = report["evaluation"], report["fp32"], report["quantized"]
    scheme = report.get("label") or report["scheme"]
    if report.get("kind") == "encoder":
        rows = [
            f"quality of {scheme} on {ev['source']}: {ev['sentences']} sentences",
            f"  cosine to fp32 embeddings: mean {report['cosine_mean']:.5f}, min {report['cosine_min']:.5f}, "
            f"5th percentile {report['cosine_p5']:.5f}",
        ]
        return "\n".join(rows + _size_rows(fp, q, scheme))
    rows = [
        f"quality of {scheme} on {ev['source']}: {ev['windows']} windows x {ev['seq_len']} tokens "
        f"({report['tokens']} predictions)",
        f"  {'':18}{'fp32':>12}{scheme:>12}{'change':>10}",
        f"  {'perplexity':18}{fp['perplexity']:>12.3f}{q['perplexity']:>12.3f}{report['perplexity_ratio']:>9.4f}x",
        *([f"  {'  + 1 s.e.':18}{'':>24}{report['perplexity_ratio_upper']:>9.4f}x  (the windows' spread; the target "
             "holds this)"] if "perplexity_ratio_upper" in report else []),
        f"  {'top-1 agreement':18}{'':>12}{report['top1_agreement']:>11.2%}",
        f"  {'mean KL (nats)':18}{'':>12}{report['mean_kl']:>12.5f}",
        f"  {'  exp(KL)':18}{'':>24}{kl_ratio(report):>9.4f}x  (the ratio on the fp32 model's own text; the target "
        "holds this too)",
    ]
    return "\n".join(rows + _size_rows(fp, q, scheme))


def _size_rows(fp: dict, q: dict, scheme: str) -> list[str]:
    rows = [f"  {'graph size':18}{'fp32':>12}{scheme:>12}{'change':>10}"]
    for name, size in fp["graph_bytes"].items():
        new = q["graph_bytes"].get(name, 0)
        rows.append(f"  {name:18}{_mib(size):>12}{_mib(new):>12}{new / size:>9.2f}x")
    return rows
