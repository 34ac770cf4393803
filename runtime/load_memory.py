"""Will an artifact load? The memory ONNX Runtime's CPU provider takes beyond the mapped file,
checked before the sessions are made, so an artifact too big for the box ends in one line with
numbers, not in the kernel's OOM killer.

weights.bin is memory-mapped: its clean pages can always be dropped again, so they do not count.
What counts is the memory the sessions allocate for themselves:

- MatMul weights are copied into packed layouts (fp32 SGEMM panels, MatMulNBits' int4/int8
  blocks): about the stored size once (the decode session; prefill loads lazily), none under
  --low-memory (fp32 only), where the kernels read the mapped file;
- an fp16 artifact has no CPU kernels: ONNX Runtime inserts casts to fp32 and folds them into
  fp32 copies of the weights (twice the stored size), which are then packed;
- block tensors stored in fewer bits than the kernels read (llmx/compact_blocks.py) are rebuilt
  in memory at load: the bytes that adds, recorded by export, come on top.
The KV cache and activations of one request come on top (``WORKING_SET``).
"""

from __future__ import annotations

from llmx.artifact.handle import Artifact
from llmx.compact_blocks import REBUILT
from llmx import memory_budget
from llmx.memory_budget import GiB, ResourceError, gib

WORKING_SET = GiB // 2


def load_need(artifact: Artifact, low_memory: bool) -> int:
    """Bytes the CPU sessions of ``artifact`` will allocate (estimate, see the module docstring)."""
    stored = sum(path.stat().st_size for path in map(artifact.file, artifact.external_data_files()) if path.is_file())
    if _fp16(artifact):
        factor = 3.0  # the fp32 copies (2x) and their packed panels (about as much again, then the copies go)
    elif low_memory:
        factor = 0.0
    else:
        factor = 1.0
    rebuilt = artifact.manifest.extras.get(REBUILT, {}).get("load_bytes", 0)
    return int(factor * stored + rebuilt) + WORKING_SET


def _fp16(artifact: Artifact) -> bool:
    precision = artifact.manifest.precision
    return "float16" in (precision.compute_dtype, precision.weights)


def check_load_fits(artifact: Artifact, low_memory: bool) -> None:
    """Raise ResourceError if loading ``artifact`` would need more memory than is available."""
    need, available = load_need(artifact, low_memory), memory_budget.available_memory()
    if need <= available:
        return
    if _fp16(artifact):
        hint = "fp16 artifacts are for GPUs (--backend ort-cuda); export --precision w4 (or fp32) for this CPU"
    elif artifact.manifest.precision.scheme:
        hint = "free memory (other processes hold it) or use a machine with more"
    elif not low_memory and load_need(artifact, True) <= available:
        hint = "--low-memory would fit (the kernels read the mapped weights)"
    else:
        hint = "export --precision w4 (or `llmx calibrate --scheme w4`) for an artifact a quarter of the size"
    raise ResourceError(f"loading {artifact.root.name} needs about {gib(need)} of memory beyond its mapped weights, "
                        f"{gib(available)} available; {hint}")

