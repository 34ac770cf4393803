"""w8/w4 MatMulNBits graphs of a candidate recipe, assembled on disk from blocks quantized once.

The search scores many weight-only candidates (recipes, per-layer sensitivity graphs, fallback
counts), and the artifact is one more. Nothing here holds a model's weights whole in memory:

- a **source** is the fp32 graphs with one channel scaling folded in (none, AWQ's at a block
  size, SmoothQuant's at an alpha): weightless protos over the prepared fp32 directory. The
  scaling changes small tensors only (norm weights divided by s, or an inserted Mul by 1/s, held
  inline); the MatMul weights stay the fp32 ones and are multiplied by s as they are quantized,
  or kept in fp32 by a candidate (then written scaled once: w8's fallbacks, and a whole run's
  per-layer sensitivity graphs), so a scaled recipe writes no copy of the model up front (an 8B
  model: 30 GB of disk a recipe, which a layered run has no room for);
- each weight's **blocks** for one (bits, block size) are quantized the first time anything asks
  for them and appended to the source's blocks file (``blocks.bin``, ``blocks-awq-32.bin``, ...),
  so the fallback and per-layer candidates of a recipe, and then the artifact, quantize nothing
  again. The rounding is ONNX Runtime's own
  (``quant_blocks.quantize_blocks``, byte for byte what its MatMulNBitsQuantizer writes), except
  an AWQ source's 4-bit blocks: importance-weighted (rounding.py, with AWQ's s folded into the
  importance), activation-aware like its scales;
- a **candidate graph** is a source proto with references into the fp32 weights and a blocks
  file, written beside them: ONNX Runtime maps the tensors instead of parsing the model from
  bytes (SmolLM2-135M's decode graph: a session in 0.5 s from a path, 2.1 s from bytes, which
  also held the model twice more).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from llmx.artifact.onnx_files import IR_VERSION, WeightsFile, load_graph, stored_in
from llmx.calibration.activations import ActivationStats
from llmx.calibration.awq import awq_scales
from llmx.calibration.candidates import Candidate, graph_bytes
from llmx.calibration.matmuls import ROW_SCALES, SHARED_WEIGHTS, initializers, read_array, weight_matmuls
from llmx.calibration.rounding import quantize_importance
from llmx.calibration.sensitivity import group_keys, nbits_probe, quantized_product, relative_error
from llmx.calibration.progress import Progress, silent
from llmx.calibration.smoothquant import apply_smoothing, groups, smoothing_scales
from llmx.calibration.weight_only import BITS, lookups_from_blocks
from llmx.quant_blocks import CPU_ACCURACY_LEVEL, NBitsWeight, quantize_blocks, replace_matmuls

BLOCKS_FILE = "blocks.bin"
# w4's 8-bit fallbacks use blocks of at least 64: an 8-bit weight's error is far below the 4-bit
# rest, and half the scales of block 32 are about 5 % of the artifact. SmolLM2-135M, default w4
# search (2026-11-27): 8-bit at block 32, 96 fallbacks, 145 MB, 1.0289 on other text, 148 tok/s;
# at block 64, 101 fallbacks, 139 MB, 1.0253, 153 tok/s (interleaved).
FALLBACK_BLOCK_8BIT = 64


@dataclass
class Source:
    dir: Path  # the prepared fp32 directory: every source's files and candidate graphs are there
    models: dict  # graph name -> weightless proto over dir's fp32 tensors (a scaling's own ones inline)
    scales: dict  # group key -> s: folded into the activations; the MatMul weights are multiplied as read
    record: dict = field(default_factory=dict)  # what the manifest says was done
    importance: bool = False  # 4-bit blocks rounded by importance (rounding.py), else round-to-nearest
    blocks_file: str = BLOCKS_FILE
    blocks: dict = field(default_factory=dict)  # (weight, bits, block size) -> NBitsWeight (references)
    copies: dict = field(default_factory=dict)  # weight -> its (scaled) fp32 tensor copied into the blocks file


class WeightOnlyBuilder:
    def __init__(self, fp32: dict[str, Path], graph: str, stats: Callable[[], ActivationStats] | None, scheme: str,
                 symmetric: bool, progress: Progress = silent):
        """``fp32``: the graphs by name, in one directory that must be the caller's own copy
        (pipeline.prepare_fp32): every recipe's blocks and graphs are written beside it, as ONNX
        Runtime reads external data only from a graph's own directory (a link out is refused, and
        onnx refuses a hard-linked file). ``graph``: the one the search scores. ``stats()`` gives
        the activation statistics (collected on first call: round-to-nearest never needs them).
        ``progress``: bars for what takes minutes on a big model (fitting AWQ, quantizing a recipe)."""
        self.graph, self.stats, self.scheme, self.symmetric, self.progress = graph, stats, scheme, symmetric, progress
        self.fp32 = {name: load_graph(path) for name, path in fp32.items()}
        self.fp32_dir = fp32[graph].parent
        self.built = 0
        self._sources: dict[tuple, Source] = {}
        self._weights = [mm.weight for mm in weight_matmuls(self.fp32[graph])]
        # weight -> its group's key, how scales are keyed (the same in every graph; the searched one's first)
        self._keys = {w: key for name in sorted(self.fp32, key=lambda n: n == graph)
                      for w, key in group_keys(self.fp32[name]).items()}

    def weights(self) -> list[str]:
        return list(self._weights)

    def source(self, candidate: Candidate) -> Source:
        """The fp32 graphs with ``candidate``'s channel scales folded in (one set for all graphs);
        AWQ's fit the blocks they round in."""
        if candidate.awq:
            key = ("awq", candidate.block_size)
        elif candidate.alpha is not None:
            key = ("sq", candidate.alpha)
        else:
            key = ("fp32",)
        if key not in self._sources:
            unscaled = key == ("fp32",)
            self._sources[key] = Source(self.fp32_dir, self.fp32, {}) if unscaled else self._scaled(candidate, key)
        return self._sources[key]

    def _scaled(self, candidate: Candidate, key: tuple) -> Source:
        """The graphs with ``candidate``'s scales folded into the activations. The MatMul weights
        keep referencing the fp32 tensors: ``blocks`` and ``_keep_fp32`` multiply them by s as
        they read them."""
        models = {name: _copy(model) for name, model in self.fp32.items()}
        searched = models[self.graph]
        if candidate.awq:
            # fitted per block size: scales fitted at 128 and used at 32 cost SmolLM2's layered w4
            # pick 1.0201 -> 1.0411 on other text (an 8B fit takes 3.5 minutes a block size)
            stats = self.stats()
            with self.progress(f"fitting AWQ scales (block {candidate.block_size})", len(groups(searched))) as bar:
                scales = awq_scales(searched, self.fp32_dir, stats, candidate.block_size, BITS[self.scheme], bar.update)
        else:
            scales = smoothing_scales(searched, self.fp32_dir, self.stats().merged_absmax(), candidate.alpha)
        counts = {name: apply_smoothing(model, self.fp32_dir, scales, scale_weights=False)
                  for name, model in models.items()}
        record = {"groups": len(scales), "per_graph": counts}
        if candidate.awq:  # activation-aware all the way: the scaled weights are rounded by importance too
            record = {"awq": {**record, "rounding": "importance"}}
        else:
            record = {"smoothquant": {"alpha": candidate.alpha, **record}}
        return Source(self.fp32_dir, models, scales, record, importance=candidate.awq,
                      blocks_file=f"blocks-{'-'.join(map(str, key))}.bin")

    def _scale(self, source: Source, weight: str) -> np.ndarray | None:
        """s of ``weight``'s group under ``source`` (None: unscaled)."""
        return source.scales.get(self._keys.get(weight))

    def _weight(self, source: Source, init) -> np.ndarray:
        """A MatMul weight of ``source`` as its recipe quantizes it: fp32, times s for a scaled group."""
        values = read_array(init, source.dir)
        s = self._scale(source, init.name)
        if s is None:
            return values
        if values.flags.writeable:  # a fresh read: scaled in place, not beside a copy (8B LM head: 2.1 GB)
            values *= s[:, None]
            return values
        return values * s[:, None]

    def blocks(self, source: Source, weights: list[tuple[str, int]], block_size: int) -> dict[str, NBitsWeight]:
        """Each (weight, bits) of ``source`` as MatMulNBits tensors referencing its blocks file,
        quantized only the first time."""
        inits = initializers(source.models[self.graph])
        missing = [(w, bits) for w, bits in weights if (w, bits, block_size) not in source.blocks]
        if missing:
            bars = self.progress if len(missing) > 1 else silent  # one weight: inside a caller's bar
            with WeightsFile(source.dir, "ab", name=source.blocks_file) as data, \
                    bars(f"quantizing {len(missing)} weights (block {block_size})", len(missing)) as bar:
                for weight, bits in missing:
                    values = self._weight(source, inits[weight])
                    if source.importance and bits == 4 and weight in self.stats().square_sum:
                        s = self._scale(source, weight)
                        importance = self.stats().mean_square(weight) / (1.0 if s is None else np.square(s))
                        blocks = quantize_importance(values, block_size, importance, self.symmetric)
                    else:
                        blocks = quantize_blocks(values, bits, block_size, self.symmetric)
                    tensors = [data.tensor(name, array) for name, array in blocks.arrays(weight)]
                    k = int(inits[weight].dims[0])
                    source.blocks[(weight, bits, block_size)] = NBitsWeight.of(blocks, k, tensors)
                    bar.update(1)
        return {w: source.blocks[(w, bits, block_size)] for w, bits in weights}

    def local_errors(self, candidate: Candidate, rows: dict[str, np.ndarray], threads: int | None = None,
                     progress: Callable[[int], None] = lambda n: None) -> dict[str, float]:
        """Each MatMul's relative output error on its calibration ``rows`` when quantized as
        ``candidate``, computed by the MatMulNBits kernel itself (sensitivity.py) on the blocks
        the candidates use."""
        from onnx import numpy_helper

        source, reference = self.source(candidate), initializers(self.fp32[self.graph])
        found = {}
        for weight in self.weights():
            s = self._scale(source, weight)
            x = rows[weight]
            exact = x @ read_array(reference[weight], self.fp32_dir)
            nbits = self.blocks(source, [(weight, BITS[self.scheme])], candidate.block_size)[weight]
            inline = [numpy_helper.from_array(read_array(t, source.dir), t.name) for t in nbits.tensors]
            probe = nbits_probe(replace(nbits, tensors=inline), weight)
            found[weight] = relative_error(exact, quantized_product(x if s is None else x / s, probe, threads))
            progress(1)
        return found

    def only(self, candidate: Candidate, weights: list[str]) -> Path:
        """The searched graph with only ``weights``' MatMuls quantized as ``candidate`` (the rest fp32)."""
        chosen = [(w, BITS[self.scheme], candidate.block_size) for w in weights]
        return self._save(self._quantized(candidate, chosen, self.graph), candidate)

    def build(self, candidate: Candidate) -> tuple[Path, int]:
        """(the searched graph's path, its tensor bytes) for ``candidate``."""
        path = self._save(self._quantized(candidate, self._precisions(candidate), self.graph), candidate)
        return path, graph_bytes(load_graph(path))

    def graphs(self, candidate: Candidate) -> tuple[dict, Path, dict]:
        """Every graph as ``candidate`` quantizes it, for the artifact: (weightless models, the
        directory their tensors are in, what the manifest records of the scaling)."""
        chosen = self._precisions(candidate)
        models = {name: self._quantized(candidate, chosen, name) for name in self.fp32}
        source = self.source(candidate)
        return models, source.dir, source.record

    def discard(self, graph: Path) -> None:
        """A candidate graph's session holds its weights now: only the graph file goes (the
        weights and blocks files stay for the next candidate)."""
        graph.unlink()

    def _precisions(self, candidate: Candidate) -> list[tuple[str, int, int]]:
        """(weight, bits, block size) of every quantized MatMul: a fallback stays fp32 under w8,
        8-bit under w4 (at FALLBACK_BLOCK_8BIT)."""
        held, block = set(candidate.fallback), candidate.block_size
        if self.scheme == "w8":
            return [(w, 8, block) for w in self.weights() if w not in held]
        wide = max(block, FALLBACK_BLOCK_8BIT)
        return [(w, 8, wide) if w in held else (w, BITS[self.scheme], block) for w in self.weights()]

    def _quantized(self, candidate: Candidate, chosen: list[tuple[str, int, int]], graph: str):
        source = self.source(candidate)
        model = _copy(source.models[graph])
        row_scales = {i.name: i for i in model.graph.initializer if i.name.endswith(ROW_SCALES)}  # read by no node
        found = {}
        for block in sorted({b for _, _, b in chosen}):
            found.update(self.blocks(source, [(w, bits) for w, bits, b in chosen if b == block], block))
        replace_matmuls(model, found, CPU_ACCURACY_LEVEL)
        if self.symmetric:
            lookups_from_blocks(model, row_scales)
        self._keep_fp32(source, model)
        return model

    def _keep_fp32(self, source: Source, model) -> None:
        """The fp32 weights a candidate keeps (w8's fallbacks) that are scaled, or read through a
        link (a layered run's prepared graphs, pipeline.prepare_fp32: ONNX Runtime refuses to
        follow a link out of the graph's directory), written into the source's blocks file once."""
        for init in model.graph.initializer:
            linked = stored_in(init, SHARED_WEIGHTS)
            if not linked and self._scale(source, init.name) is None:
                continue
            if init.name not in source.copies:
                with WeightsFile(source.dir, "ab", name=source.blocks_file) as data:
                    source.copies[init.name] = data.tensor(init.name, self._weight(source, init))
            init.CopyFrom(source.copies[init.name])

    def _save(self, model, candidate: Candidate) -> Path:
        import onnx

        self.built += 1
        path = self.source(candidate).dir / f"candidate-{self.built}.onnx"
        model.ir_version = IR_VERSION
        onnx.save_model(model, str(path))
        return path


def _copy(model):
    import onnx

    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    return copy
