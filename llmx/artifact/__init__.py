"""The artifact: a directory of graphs, a tokenizer and the manifest ``llmx.json``, the one
contract between stages (docs/artifact.md).

    handle.py      Artifact: the handle every stage, backend and the tokenizer take
    manifest.py    Manifest: load, check, save; checksums
    sections.py    the manifest's typed sections (graphs, KV layout, precision, tokenizer, lineage)
    schema.py      JSON <-> typed sections, with one error line per bad field
    tensorrt.py    the TensorRT section: build limits, optimization profiles, the engine record
    paths.py       files an artifact names, resolved inside it and nowhere else
    staging.py     writing an artifact atomically (temp dir, manifest last, rename)
    onnx_files.py  saving and describing ONNX graphs with one shared weights.bin (needs onnx)
"""

from llmx.artifact.handle import Artifact

__all__ = ["Artifact"]
