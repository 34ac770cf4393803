"""ONNX Runtime on a GPU (``--backend ort-cuda`` / ``ort-tensorrt``), KV cache in device memory.

The data path of the TensorRT backend with ONNX Runtime sessions: the cache is a
DeviceKVCache; decode binds its buffers as past and present by device pointer (IO binding),
so the graph's scatter updates them in place; prefill writes its presents into device scratch
that is copied into cache rows on the device. The small integer inputs go in with
``bind_cpu_input`` (ORT copies them) and logits come back into a host array: one small copy
each way per step. ORT runs on llmx's CUDA stream (``user_compute_stream``), so its kernels
and llmx's copies are ordered.

The TensorRT execution provider gets its optimization profiles from the same functions
``llmx build`` uses (llmx/artifact/tensorrt.py; limits from the manifest's engine record, or the
defaults), and keeps engines and timing caches under llmx's cache directory, keyed by the
graph's checksum.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import numpy as np

from llmx.artifact.handle import Artifact
from llmx.cuda import open_device
from llmx.artifact.tensorrt import axis_ranges, graph_profile, llmx_cache_dir, ort_trt_profile_options
from llmx.errors import ArtifactError, InputError, LlmxError
from llmx.artifact.manifest import Manifest
from llmx.runtime.device_cache import DeviceBuffers, DeviceKVCache, scratch_presents, take_prompts
from llmx.runtime.onnx_backend import PROVIDERS, _ort, session_options
from llmx.runtime.ort_cuda_graph import CudaGraphDecode
from llmx.runtime.step_inputs import bind_decode_inputs, prompt_inputs

log = logging.getLogger(__name__)
GPU_HINT = "pip install 'llmx[gpu]' instead of 'llmx[cpu]' (onnxruntime-gpu; the two cannot be installed together)"


def tensorrt_provider_options(manifest: Manifest, graph: str, cache_root: Path, device_index: int = 0,
                              workspace_bytes: int | None = None) -> dict[str, str]:
    """TensorRT execution provider options for one graph: profile shapes and caches."""
    limits = manifest.engine_limits
    kind = "prefill" if graph == "prefill" else "decode"
    profile = graph_profile(kind, manifest.graphs[graph], axis_ranges(kind, limits))
    key = hashlib.sha256(f"{manifest.checksums.get(manifest.graphs[graph].file)}|{limits.to_dict()}".encode()).hexdigest()[:16]
    cache = Path(cache_root) / "ort-tensorrt" / f"{graph}-{key}"
    options = {
        "device_id": str(device_index),
        "trt_engine_cache_enable": "True",
        "trt_engine_cache_path": str(cache),
        "trt_timing_cache_enable": "True",
        "trt_timing_cache_path": str(cache),
        **ort_trt_profile_options(profile),
    }
    if workspace_bytes:
        options["trt_max_workspace_size"] = str(workspace_bytes)
    return options


class OrtDeviceBackend:
    """Runs an artifact's graphs on ONNX Runtime's CUDA or TensorRT provider (a Backend)."""

    def __init__(self, artifact: Artifact, provider: str = "cuda", threads: int | None = None,
                 device: int = 0, optimization: str = "all", workspace_bytes: int | None = None, spin: bool = False,
                 cuda_graph: bool | None = None):
        ort = _ort()
        if provider not in PROVIDERS:
            raise InputError(f"provider must be one of {', '.join(PROVIDERS)}, got {provider!r}")
        available = ort.get_available_providers()
        if PROVIDERS[provider] not in available:
            raise LlmxError(f"--backend ort-{provider} needs ONNX Runtime's {PROVIDERS[provider]}, which this "
                            f"onnxruntime lacks: {GPU_HINT}")
        manifest = artifact.manifest
        kv = manifest.kv
        self.kv_dtype = kv.dtype
        if self.kv_dtype not in ("float32", "float16"):
            raise InputError(f"ONNX Runtime's Python IO binding cannot bind {self.kv_dtype} buffers; use --backend tensorrt")
        self.device = open_device(device)  # ort-gpu lists CUDA providers even with no GPU: look for one
        self.artifact, self.manifest = artifact, manifest
        self.device_type = "cpu" if provider == "cpu" else "cuda"
        self.device_index = 0 if provider == "cpu" else device
        self.num_layers, self.kv_heads, self.head_dim = kv.num_layers, kv.num_kv_heads, kv.head_dim
        self.vocab_size = manifest.model.vocab_size
        self.past_names, self.present_names = kv.past_names(), kv.present_names()
        opts = session_options(threads, optimization, spin=spin)  # CPU threads run the nodes the GPU providers leave
        self.sessions = {"prefill": self._session(ort, "prefill", provider, opts, workspace_bytes)}
        self.cuda_graph = None
        if self._wants_cuda_graph(provider, cuda_graph):
            try:
                self.cuda_graph = self._captured_decode(ort, provider, opts)
            except ArtifactError as exc:
                if cuda_graph:  # asked for by name: say why it cannot be had
                    raise
                log.warning("%s; decoding with plain steps", exc)
        self.sessions["decode"] = self.cuda_graph.session if self.cuda_graph else self._session(
            ort, "decode", provider, opts, workspace_bytes)
        self.limit = manifest.engine_limits.max_seq_len if provider == "tensorrt" else manifest.max_seq_len
        self.buffers = DeviceBuffers(self.device)
        self._decode_binding = self.sessions["decode"].io_binding()
        self._logits: np.ndarray | None = None
        self.prefill_calls = 0

    def _session(self, ort, name: str, provider: str, opts, workspace_bytes):
        graph = self.artifact.graph(name)
        path = self.artifact.existing_file(graph.file, f"graphs.{name}.file")
        stream = {"user_compute_stream": str(self.device.stream), "has_user_compute_stream": "1"}
        # use_tf32 off: fp32 graphs stay fp32 (as on the CPU backend); fp16 graphs are the fast path.
        cuda = ("CUDAExecutionProvider", {"device_id": str(self.device_index), "use_tf32": "0", **stream})
        providers = {
            "cpu": ["CPUExecutionProvider"],
            "cuda": [cuda, "CPUExecutionProvider"],
            "tensorrt": [("TensorrtExecutionProvider", {**tensorrt_provider_options(
                self.manifest, name, llmx_cache_dir(), self.device_index, workspace_bytes), **stream}), cuda, "CPUExecutionProvider"],
        }[provider]
        try:
            return ort.InferenceSession(str(path), opts, providers=providers)
        except Exception as exc:
            raise ArtifactError(f"ONNX Runtime cannot load {graph.file} on {provider}: {str(exc).splitlines()[0]}") from exc

    def _wants_cuda_graph(self, provider: str, requested: bool | None) -> bool:
        """Default: on for the CUDA provider with a portable decode graph (the only kind ORT captures).
        The CPU provider takes the same path on request, which is how tests run it without a GPU."""
        portable = self.manifest.graphs["decode"].ops == "portable" if "decode" in self.manifest.graphs else False
        if requested and (provider == "tensorrt" or not portable):
            raise InputError("CUDA graphs need --backend ort-cuda and a portable (not optimized) decode graph")
        return portable and provider == "cuda" if requested is None else requested

    def _captured_decode(self, ort, provider: str, opts) -> CudaGraphDecode:
        cuda = {"device_id": str(self.device_index), "use_tf32": "0", "enable_cuda_graph": "1"}
        providers = [("CUDAExecutionProvider", cuda)] if provider == "cuda" else ["CPUExecutionProvider"]
        return CudaGraphDecode(ort, self.artifact.graph_path("decode"), opts, providers, self.device, self.device_type,
                               self.device_index, self.vocab_size, self._bind_kv)

    @property
    def max_seq_len(self) -> int:
        return self.limit

    def new_cache(self, rows: int, capacity: int) -> DeviceKVCache:
        return DeviceKVCache(self.device, self.num_layers, self.kv_heads, self.head_dim, rows, capacity,
                             self.max_seq_len, self.kv_dtype)

    def _bind_kv(self, binding, names: list[str], shape: tuple, ptrs: list[int], output: bool) -> None:
        bind = binding.bind_output if output else binding.bind_input
        for name, ptr in zip(names, ptrs):
            bind(name, self.device_type, self.device_index, np.dtype(self.kv_dtype), shape, ptr)

    def prefill(self, cache: DeviceKVCache, rows: list[int], prompts: list[list[int]], padding: str = "right") -> np.ndarray:
        """Run whole prompts; their keys/values land in ``rows``; last-position logits [n, V]."""
        ids, mask, positions, lengths = prompt_inputs(prompts, padding)
        b, width = ids.shape
        cache.ensure_capacity(width)
        binding = self.sessions["prefill"].io_binding()
        for name, value in (("input_ids", ids), ("attention_mask", mask), ("position_ids", positions)):
            binding.bind_cpu_input(name, value)
        all_logits = self.manifest.graphs["prefill"].outputs[0].shape[1] != 1
        logits = np.empty((b, width if all_logits else 1, self.vocab_size), np.float32)
        binding.bind_output("logits", "cpu", 0, np.float32, logits.shape, logits.ctypes.data)
        presents = scratch_presents(self.buffers, cache, b, width)
        self._bind_kv(binding, self.present_names, (b, self.kv_heads, width, self.head_dim), presents, output=True)
        self.device.synchronize()
        self.sessions["prefill"].run_with_iobinding(binding)
        self.prefill_calls += 1
        take_prompts(cache, rows, lengths, width, padding, presents)
        if all_logits:
            picks = [width - 1 if padding == "left" else n - 1 for n in lengths]
            return logits[np.arange(b), picks]
        return logits[:, 0]

    def decode(self, cache: DeviceKVCache, input_ids: np.ndarray, last_only: bool = False) -> np.ndarray:
        """Append ``input_ids`` [n, T] to rows 0..n-1 of ``cache``; logits [n, T, V] (also with ``last_only``:
        logits_to_keep is left at its default, all positions, so the bound shapes stay as captured)."""
        if self.cuda_graph:
            return self.cuda_graph.step(cache, input_ids, (self.past_names, self.present_names))
        n, t = input_ids.shape
        b = self._decode_binding
        bind_decode_inputs(b, cache, input_ids)
        shape = (n, self.kv_heads, cache.capacity, self.head_dim)
        self._bind_kv(b, self.past_names, shape, cache.buffers, output=False)
        self._bind_kv(b, self.present_names, shape, cache.buffers, output=True)
        if self._logits is None or self._logits.shape != (n, t, self.vocab_size):
            self._logits = np.empty((n, t, self.vocab_size), np.float32)
        b.bind_output("logits", "cpu", 0, np.float32, self._logits.shape, self._logits.ctypes.data)
        self.device.synchronize()  # cache copies on llmx's stream finish before ORT reads the cache
        self.sessions["decode"].run_with_iobinding(b)
        cache.lengths[:n] += t
        return self._logits
