"""Draw docs/pipeline.png: llmx's stages and what runs each artifact (matplotlib)."""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyBboxPatch  # noqa: E402

USES = ["llmx generate", "llmx bench", "llmx eval", "llmx serve\n(OpenAI API)", "llmx embed"]


def box(ax, x, y, w, h, text, color):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02", fc=color, ec="#444444", lw=1))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=9)


def arrow(ax, start, end):
    ax.annotate("", xy=end, xytext=start, arrowprops=dict(arrowstyle="->", lw=1.2))


def main() -> None:
    fig, ax = plt.subplots(figsize=(11, 4.2))
    ax.set_xlim(0, 11)
    ax.set_ylim(0, 4.2)
    ax.axis("off")
    w, h = 1.9, 0.75
    stage = "#cfe2f3"
    box(ax, 0.1, 2.45, w, h, "HF checkpoint\n(local dir)", "#dddddd")
    box(ax, 2.45, 2.45, w, h, "llmx export\nprefill + decode ONNX", stage)
    arrow(ax, (2.0, 2.82), (2.45, 2.82))
    # ONNX Runtime lane (CPU / CUDA): fused graphs, then quantized.
    box(ax, 4.95, 3.3, w, h, "llmx optimize\nfused ORT graphs", stage)
    box(ax, 7.45, 3.3, w, h, "llmx calibrate\nw8 / w4 / w8a8 + report", stage)
    arrow(ax, (4.35, 3.0), (4.95, 3.6))
    arrow(ax, (6.85, 3.67), (7.45, 3.67))
    ax.text(9.45, 3.67, "ONNX Runtime\nCPU / CUDA", fontsize=8, va="center")
    # TensorRT lane: portable graphs (Q/DQ for INT8), then engines.
    box(ax, 4.95, 1.6, w, h, "llmx calibrate\nw8a8 Q/DQ (optional)", stage)
    box(ax, 7.45, 1.6, w, h, "llmx build\nTensorRT engines", stage)
    arrow(ax, (4.35, 2.65), (4.95, 2.05))
    arrow(ax, (6.85, 1.97), (7.45, 1.97))
    ax.text(9.45, 1.97, "TensorRT\n(GPU)", fontsize=8, va="center")
    ax.text(5.5, 1.2, "every stage reads an artifact (llmx.json manifest + graphs + tokenizer) and writes a new one; "
            "any artifact runs in:", ha="center", fontsize=9, style="italic")
    for i, text in enumerate(USES):
        box(ax, 0.6 + i * 2.05, 0.15, 1.7, 0.75, text, "#d9ead3")
    out = Path(__file__).resolve().parents[1] / "docs" / "pipeline.png"
    fig.savefig(out, dpi=110, bbox_inches="tight")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
