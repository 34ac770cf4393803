"""Decode steps that ONNX Runtime's CUDA provider captures once and replays as CUDA graphs.

With ``enable_cuda_graph`` a session records a run into a CUDA graph and replays it as one
launch instead of the ~2,000 kernel launches a 30-layer step issues from the host (measured on
an H100, SmolLM-135M shape, batch 1: 10.2 ms -> 3.4 ms a step; benchmarks/gpu_verify.py). The
price is that every input and output must stay at one device address with one shape, so:

- the step's ids, positions and mask live in device buffers of their own, uploaded before each
  run, and logits land in a device buffer that is copied to the host after it;
- the mask spans the cache's whole capacity, zeros past each row's length: the same logits
  (masked slots get zero weight), with attention over more slots than the context holds;
- one graph per (cache buffers, rows, tokens, capacity): a cache that grows gets new graphs.

ONNX Runtime captures a graph only if no step copies between host and GPU: shape arithmetic may
run on the CPU (the CUDA provider leaves int64 math fed by Shape outputs there), but a value
computed on the GPU and read on the host (a Slice's starts, say) inserts a Memcpy and is refused.
The portable graphs qualify (llmx/logits_to_keep.py keeps its slice start on the host for this);
the fused (optimized) graphs do not. Where capture is refused and was not asked for by name, the
backend decodes with plain steps.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llmx.errors import ArtifactError
from llmx.runtime.step_inputs import decode_inputs

MAX_GRAPHS = 16  # captured steps kept (one per batch size / cache size seen); ORT keeps its own copy


@dataclass
class CapturedStep:
    graph_id: int
    binding: object  # onnxruntime IOBinding bound to the buffers below
    inputs: dict[str, int]  # input name -> device pointer
    logits_ptr: int
    logits: np.ndarray  # host copy of the step's logits [n, T, V]


class CudaGraphDecode:
    """The decode graph in its own session with graph capture on; ``step`` replaces one decode call."""

    def __init__(self, ort, path: Path, opts, providers: list, device, device_type: str, device_index: int,
                 vocab_size: int, bind_kv):
        try:
            self.session = ort.InferenceSession(str(path), opts, providers=providers)
        except Exception as exc:
            raise ArtifactError(f"ONNX Runtime cannot capture {path.name} as a CUDA graph: {str(exc).splitlines()[0]} "
                                "(a value computed on the GPU is copied to the host inside the step)") from exc
        self.ort, self.device, self.device_type, self.device_index = ort, device, device_type, device_index
        self.vocab_size, self.bind_kv = vocab_size, bind_kv
        self.steps: OrderedDict[tuple, CapturedStep] = OrderedDict()
        self.next_id = 0

    def step(self, cache, input_ids: np.ndarray, kv_names: tuple[list[str], list[str]]) -> np.ndarray:
        """Append ``input_ids`` [n, T] to rows 0..n-1 of ``cache``; logits [n, T, V]."""
        n, t = input_ids.shape
        lengths = cache.lengths[:n]
        cache.ensure_capacity(int(lengths.max()) + t)
        key = (tuple(cache.buffers), n, t, cache.capacity)
        captured = self.steps.get(key) or self._capture(key, cache, n, t, kv_names)
        self.steps.move_to_end(key)
        positions, mask = decode_inputs(lengths, t, cache.capacity)
        for name, value in (("input_ids", input_ids), ("position_ids", positions), ("attention_mask", mask)):
            self.device.upload(captured.inputs[name], np.ascontiguousarray(value, dtype=np.int64))
        self.device.synchronize()  # uploads and cache copies on llmx's stream land before ORT's run
        options = self.ort.RunOptions()
        options.add_run_config_entry("gpu_graph_id", str(captured.graph_id))
        self.session.run_with_iobinding(captured.binding, options)
        self.device.download(captured.logits, captured.logits_ptr)
        cache.lengths[:n] += t
        return captured.logits

    def _capture(self, key: tuple, cache, n: int, t: int, kv_names: tuple[list[str], list[str]]) -> CapturedStep:
        binding = self.session.io_binding()
        shapes = {"input_ids": (n, t), "position_ids": (n, t), "attention_mask": (n, cache.capacity)}
        inputs = {}
        for name, shape in shapes.items():
            inputs[name] = self.device.alloc(int(np.prod(shape)) * 8)
            binding.bind_input(name, self.device_type, self.device_index, np.int64, shape, inputs[name])
        kv_shape = (n, cache.kv_heads, cache.capacity, cache.head_dim)
        self.bind_kv(binding, kv_names[0], kv_shape, cache.buffers, output=False)
        self.bind_kv(binding, kv_names[1], kv_shape, cache.buffers, output=True)
        logits = np.empty((n, t, self.vocab_size), np.float32)
        logits_ptr = self.device.alloc(logits.nbytes)
        binding.bind_output("logits", self.device_type, self.device_index, np.float32, logits.shape, logits_ptr)
        captured = CapturedStep(self.next_id, binding, inputs, logits_ptr, logits)
        self.next_id += 1
        self.steps[key] = captured
        while len(self.steps) > MAX_GRAPHS:
            _, old = self.steps.popitem(last=False)  # never replayed again: its graph id is not reused
            for ptr in (*old.inputs.values(), old.logits_ptr):
                self.device.free(ptr)
        return captured
