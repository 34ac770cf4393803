"""The TensorRT backend: engines built by ``llmx build``, KV cache resident on the GPU.

    prefill: prompts -> engine -> keys/values copied on the device into cache rows -> last logits
    decode:  ids/positions/mask (one small upload) -> engine with past == present (the cache
             buffers, bound with set_tensor_address) -> logits (one small download)

Nothing of the cache crosses to the host. Decode binds the first ``n`` rows of each layer's
buffer as both past and present, so the graph's scatter updates it in place (as the ONNX
Runtime backend does). Decode attends over the whole cache capacity (masked beyond each
row's length) so its shapes stay fixed while a batch decodes, which lets each step replay a
captured CUDA graph instead of launching every kernel from Python.

Layouts (``llmx build --layout``): ``split`` has a prefill engine and a decode engine;
``shared`` has one engine built from the decode graph with a prefill profile (prompts go in
as chunks into an empty cache) and a decode profile, each with its own execution context.
"""

from __future__ import annotations

import sys

import numpy as np

from llmx.artifact.handle import Artifact
from llmx.cuda import ALIGN, open_device
from llmx.artifact.tensorrt import TENSORRT_HINT, TensorRTRecord, check_engine_compatible
from llmx.errors import ArtifactError, InputError, require
from llmx.runtime.device_cache import DeviceBuffers, DeviceKVCache, scratch_presents, take_prompts
from llmx.runtime.kv_cache import round_up
from llmx.runtime.step_inputs import decode_inputs, prompt_inputs
from llmx.runtime.trt_context import TrtContext

TRT_DTYPES = {"FLOAT": "float32", "HALF": "float16", "BF16": "bfloat16", "INT64": "int64", "INT32": "int32"}


class TensorRTBackend:
    """Runs an artifact's TensorRT engines (a Backend)."""

    def __init__(self, artifact: Artifact, threads: int | None = None, device: int = 0,
                 cuda_graphs: bool = True, kv_in_place: bool = True):
        self.artifact = artifact
        self.manifest = manifest = artifact.manifest
        record = manifest.tensorrt
        if record is None:
            raise ArtifactError(f"{artifact.root} has no TensorRT engines; build them with `llmx build {artifact.root} -o OUT`")
        trt = require("tensorrt", "--backend tensorrt", hint=TENSORRT_HINT, name="TensorRT")
        self.device = open_device(device)
        for warning in check_engine_compatible(record, trt.__version__, self.device.record()):
            print(f"warning: {warning}", file=sys.stderr)
        kv = manifest.kv
        self.num_layers, self.kv_heads, self.head_dim = kv.num_layers, kv.num_kv_heads, kv.head_dim
        self.kv_dtype = kv.dtype
        self.vocab_size = manifest.model.vocab_size
        self.past_names, self.present_names = kv.past_names(), kv.present_names()
        self.limits, self.layout, self.cuda_graphs = record.limits, record.layout, cuda_graphs
        # kv_in_place=False: present goes to scratch and is copied back (one cache copy per step),
        # for a TensorRT that refuses or mishandles past and present bound to the same memory.
        self.kv_in_place = kv_in_place
        self.engines = self._load_engines(trt, record)
        main = "prefill" if self.layout == "split" else "model"
        self.prefill_ctx = TrtContext(trt, self.engines[main], 0, self.device, f"{main}.engine (prefill)")
        decode_engine = self.engines["decode" if self.layout == "split" else "model"]
        self.decode_ctx = TrtContext(trt, decode_engine, 0 if self.layout == "split" else 1, self.device, "decode")
        self._check_dtypes(trt)
        self.buffers = DeviceBuffers(self.device)
        self._logits_host: np.ndarray | None = None
        self.prefill_calls = 0

    def _load_engines(self, trt, record: TensorRTRecord) -> dict:
        runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        engines = {}
        for name, info in record.engines.items():
            path = self.artifact.existing_file(info.file, f"tensorrt.engines.{name}.file")
            engine = runtime.deserialize_cuda_engine(path.read_bytes())
            if engine is None:
                raise ArtifactError(f"TensorRT cannot load {info.file} (see its messages above); rebuild with `llmx build`")
            engines[name] = engine
        return engines

    def _check_dtypes(self, trt) -> None:
        engine = self.engines["decode" if self.layout == "split" else "model"]
        want = {"input_ids": "int64", "logits": "float32", self.past_names[0]: self.kv_dtype}
        for name, dtype in want.items():
            have = TRT_DTYPES.get(engine.get_tensor_dtype(name).name)
            if have != dtype:
                raise ArtifactError(f"engine tensor {name} is {have}, the manifest says {dtype}; rebuild with `llmx build`")

    @property
    def max_seq_len(self) -> int:
        return self.limits.max_seq_len  # resolved by the build: at most the model's maximum

    def new_cache(self, rows: int, capacity: int) -> DeviceKVCache:
        if rows > self.limits.max_batch:
            raise InputError(f"batch of {rows} exceeds the engines' --max-batch {self.limits.max_batch}; rebuild to raise it")
        return DeviceKVCache(self.device, self.num_layers, self.kv_heads, self.head_dim, rows, capacity,
                             self.max_seq_len, self.kv_dtype)

    # -- prefill ---------------------------------------------------------------------------

    def prefill(self, cache: DeviceKVCache, rows: list[int], prompts: list[list[int]], padding: str = "right") -> np.ndarray:
        """Run whole prompts; their keys/values land in ``rows``; last-position logits [n, V]."""
        width = max(len(p) for p in prompts)
        if width > self.max_seq_len:
            raise InputError(f"prompt of {width} tokens exceeds the engines' --max-seq-len {self.max_seq_len}")
        cache.ensure_capacity(width)
        self.prefill_calls += 1
        if self.layout == "split":
            return self._prefill_engine(cache, rows, prompts, padding)
        return self._prefill_chunks(cache, rows, prompts)

    def _prefill_engine(self, cache, rows, prompts, padding) -> np.ndarray:
        ids, mask, positions, lengths = prompt_inputs(prompts, padding)
        b, width = ids.shape
        addresses = self.buffers.upload("prefill_inputs", {"input_ids": ids, "attention_mask": mask, "position_ids": positions})
        all_logits = self.manifest.graphs["prefill"].outputs[0].shape[1] != 1
        logits_rows = width if all_logits else 1
        addresses["logits"] = self.buffers.get("prefill_logits", b * logits_rows * self.vocab_size * 4)
        presents = scratch_presents(self.buffers, cache, b, width)
        addresses.update(zip(self.present_names, presents))
        shapes = {"input_ids": (b, width), "attention_mask": (b, width), "position_ids": (b, width)}
        self.prefill_ctx.run(shapes, addresses)
        take_prompts(cache, rows, lengths, width, padding, presents)
        picks = [(width - 1 if padding == "left" else n - 1) if all_logits else 0 for n in lengths]
        return self._download_logits(addresses["logits"], logits_rows, picks)

    def _prefill_chunks(self, cache, rows, prompts) -> np.ndarray:
        """Shared layout: the decode graph (profile 0) takes each prompt in chunks into its rows."""
        start = rows[0]
        if list(rows) != list(range(start, start + len(rows))):
            raise InputError("prefill rows must be contiguous")
        ids, mask, _, lengths = prompt_inputs(prompts, "right")
        b, width = ids.shape
        chunk = self.limits.prefill_chunk
        logits = np.empty((b, self.vocab_size), np.float32)
        kv_shape = (b, self.kv_heads, cache.capacity, self.head_dim)
        for off in range(0, width, chunk):
            t = min(chunk, width - off)
            # Pads get positions past their row's length: their slots are overwritten before use.
            positions = np.broadcast_to(np.arange(off, off + t, dtype=np.int64), (b, t))
            addresses = self.buffers.upload("prefill_inputs", {
                "input_ids": ids[:, off:off + t], "attention_mask": mask[:, :off + t], "position_ids": positions})
            addresses["logits"] = self.buffers.get("prefill_logits", b * t * self.vocab_size * 4)
            copies = self._bind_cache(addresses, cache, start, b)
            shapes = {"input_ids": (b, t), "position_ids": (b, t), "attention_mask": (b, off + t),
                      **{name: kv_shape for name in self.past_names}}
            self.prefill_ctx.run(shapes, addresses)
            self._copy_back(copies)
            done = [i for i, n in enumerate(lengths) if off <= n - 1 < off + t]
            if done:
                picked = self._download_logits(addresses["logits"], t, [lengths[i] - 1 - off for i in done], done)
                logits[done] = picked
        cache.lengths[start:start + b] = lengths
        return logits

    def _download_logits(self, ptr: int, per_row: int, picks: list[int], rows: list[int] | None = None) -> np.ndarray:
        """Logits of position ``picks[k]`` of batch row ``rows[k]`` (default 0..): [k, V]."""
        rows = list(range(len(picks))) if rows is None else rows
        row_bytes = self.vocab_size * 4
        out = np.empty((len(picks), self.vocab_size), np.float32)
        if per_row == 1 and rows == list(range(len(rows))):
            return self.device.download(out, ptr)
        for k, (row, pick) in enumerate(zip(rows, picks)):
            self.device.download(out[k], ptr + (row * per_row + pick) * row_bytes)
        return out

    # -- decode ----------------------------------------------------------------------------

    def decode(self, cache: DeviceKVCache, input_ids: np.ndarray, last_only: bool = False) -> np.ndarray:
        """Append ``input_ids`` [n, T] to rows 0..n-1 of ``cache``; logits [n, T, V] (also with ``last_only``:
        logits_to_keep is left at its default, all positions, so the bound shapes stay as captured)."""
        n, t = input_ids.shape
        lengths = cache.lengths[:n]
        total = int(lengths.max()) + t
        cache.ensure_capacity(total)
        # Attending over the whole capacity keeps shapes fixed between steps (graph replay).
        width = cache.capacity if self.cuda_graphs else total
        positions, mask = decode_inputs(lengths, t, width)
        addresses = self.buffers.upload("decode_inputs", {
            "input_ids": np.ascontiguousarray(input_ids, dtype=np.int64), "attention_mask": mask, "position_ids": positions})
        addresses["logits"] = self.buffers.get("decode_logits", n * t * self.vocab_size * 4)
        copies = self._bind_cache(addresses, cache, 0, n)
        kv_shape = (n, self.kv_heads, cache.capacity, self.head_dim)
        shapes = {"input_ids": (n, t), "position_ids": (n, t), "attention_mask": (n, width),
                  **{name: kv_shape for name in self.past_names}}
        self.decode_ctx.run(shapes, addresses, graph=self.cuda_graphs)
        self._copy_back(copies)
        if self._logits_host is None or self._logits_host.shape != (n, t, self.vocab_size):
            self._logits_host = np.empty((n, t, self.vocab_size), np.float32)
        self.device.download(self._logits_host, addresses["logits"])
        cache.lengths[:n] += t
        return self._logits_host

    def _bind_cache(self, addresses: dict, cache: DeviceKVCache, first_row: int, rows: int) -> list[tuple[int, int, int]]:
        """Bind rows first_row.. of each cache buffer as past and (in place) present; else
        present to scratch, returning the (dst, src, nbytes) copies that bring it back."""
        nbytes, copies = rows * cache.row_bytes, []
        stride = round_up(nbytes, ALIGN)
        scratch = None if self.kv_in_place else self.buffers.get("present_scratch", stride * len(self.present_names))
        for i, (past, present) in enumerate(zip(self.past_names, self.present_names)):
            addresses[past] = cache.row_ptr(i, first_row)
            addresses[present] = addresses[past] if scratch is None else scratch + i * stride
            if scratch is not None:
                copies.append((addresses[past], addresses[present], nbytes))
        return copies

    def _copy_back(self, copies: list[tuple[int, int, int]]) -> None:
        for dst, src, nbytes in copies:
            self.device.copy(dst, src, nbytes)

    def close(self) -> None:
        self.prefill_ctx.close()
        self.decode_ctx.close()
        self.device.synchronize()
        self.buffers.close()

