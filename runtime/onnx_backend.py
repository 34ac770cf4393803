"""The ONNX Runtime backend: prefill and decode graphs driven through IO binding.

Decode binds each layer's KV buffer (the first ``n`` rows: a contiguous view) as both past and
present, so the graph's scatter writes new entries in place: no step allocates or copies the
cache. Logits land in a reused output buffer. Prefill runs the prefill graph and copies each
sequence's keys/values into its cache row once.
"""

from __future__ import annotations

import os

import numpy as np

from llmx.artifact.handle import Artifact
from llmx.compact_blocks import REBUILT
from llmx.errors import ArtifactError, InputError, LlmxError, require
from llmx.logits_to_keep import NAME as LOGITS_TO_KEEP
from llmx.runtime import huge_pages
from llmx.runtime.cpu_plan import physical_cores, plan_threads
from llmx.runtime.kv_cache import KVCache
from llmx.runtime.load_memory import check_load_fits
from llmx.runtime.rebuilt_weights import RebuiltWeights
from llmx.runtime.step_inputs import bind_decode_inputs, prompt_inputs

PROVIDERS = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
}


def _ort():
    return require("onnxruntime", "running ONNX graphs", "cpu")


def session_options(threads: int | None = None, optimization: str = "all", spin: bool = False, prepack: bool = True):
    ort = _ort()
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads or physical_cores()
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    levels = {
        "none": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }
    if optimization not in levels:
        raise InputError(f"optimization level must be one of {', '.join(levels)}, got {optimization!r}")
    opts.graph_optimization_level = levels[optimization]
    # Spinning workers wait for the next op by busy-looping: fastest when each thread has a core of
    # its own, 2-3x slower when one is descheduled (runtime/cpu_plan.py decides). When they spin,
    # they stop at the end of every run, so nothing burns between decode steps' Python work or
    # while a server is idle.
    opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    if spin:
        opts.add_session_config_entry("session.force_spinning_stop", "1")
    if not prepack:
        # ONNX Runtime memory-maps weights.bin (its tensors sit on 64 KiB boundaries) but then
        # copies every MatMul weight into a packed layout, once per session. Without that copy the
        # kernels read the mapped file: prefill and decode (and every process serving the same
        # artifact) share one copy in the page cache. SmolLM shape, fp32: 1164 -> 650 MB PSS,
        # decode ~5 % and TTFT ~10 % slower (docs/performance.md).
        opts.add_session_config_entry("session.disable_prepacking", "1")
    opts.log_severity_level = 3
    return opts


class _MappedFiles:
    """The weights files ONNX Runtime memory-maps under --low-memory, and their sizes at load.

    Reading a mapped page past a file's new end kills the process with SIGBUS, so a file that
    shrinks under a running server (an artifact overwritten in place) must be caught before the
    next graph run. fstat on descriptors opened at load follows the mapped inode: replacing the
    artifact by rename (what llmx's writers do) leaves the mapping, and this check, intact.
    """

    def __init__(self, artifact: Artifact):
        self.files = {}
        for rel in artifact.external_data_files():
            fd = os.open(artifact.file(rel, "external_data"), os.O_RDONLY)
            self.files[rel] = (fd, os.fstat(fd).st_size)

    def check(self) -> None:
        for rel, (fd, size) in self.files.items():
            now = os.fstat(fd).st_size
            if now != size:
                raise ArtifactError(f"{rel} changed size under --low-memory ({size} -> {now} bytes) while memory-mapped: "
                                    "the artifact was overwritten in place; restart on a complete copy")

    def __del__(self) -> None:
        for fd, _ in self.files.values():
            os.close(fd)


class OrtBackend:
    """Runs an artifact's prefill/decode graphs on one ONNX Runtime execution provider (a Backend)."""

    def __init__(self, artifact: Artifact, provider: str = "cpu", threads: int | None = None,
                 optimization: str | None = None, spin: bool | None = None, low_memory: bool = False,
                 lazy_prefill: bool | None = None):
        _ort()
        if provider not in PROVIDERS:
            raise InputError(f"provider must be one of {', '.join(PROVIDERS)}, got {provider!r}")
        if provider != "cpu":
            raise LlmxError(f"the {provider} provider needs device-resident KV buffers; use --backend ort-cpu here")
        self.artifact = artifact
        self.manifest = manifest = artifact.manifest
        if "bfloat16" in (manifest.precision.compute_dtype, manifest.kv.dtype):
            raise InputError("this artifact computes in bfloat16, which ONNX Runtime's CPU provider has no kernels for; "
                             "run it on a GPU (--backend ort-cuda, or `llmx build`), or export --precision fp16 or fp32")
        if low_memory and manifest.precision.scheme:
            # MatMulNBits and the int8 kernels compute from their packed weights only: measured 20x
            # slower decode without them, for a third less memory.
            raise InputError(f"--low-memory applies to unquantized artifacts; this one is "
                             f"{manifest.precision.scheme} (its kernels need their packed weights)")
        self.low_memory = low_memory
        check_load_fits(artifact, low_memory)
        # None: decided from the cores free now (runtime/cpu_plan.py); the plan is kept for bench/serve to report.
        self.cpu_plan = plan_threads(threads, spin)
        self._ort_provider, self._optimization = PROVIDERS[provider], optimization
        self._rebuilt = RebuiltWeights()  # block tensors stored small, rebuilt once for both sessions
        # --low-memory's weights stay in the mapped file; packed ones get 2 MiB pages (runtime/huge_pages.py).
        self._huge_pages = huge_pages.enabled() and not low_memory
        for name in ("prefill", "decode"):
            artifact.graph(name)  # both are needed, even the prefill graph loaded later
        self.sessions = {"decode": self._load("decode")}
        # One prepacked copy of the weights, not two: a single prompt is prefilled by the decode
        # graph (it takes T new tokens after an empty past), so the prefill graph, whose session
        # packs its own copy of every weight, loads only when a batch of prompts needs it.
        # logits_to_keep=1 keeps its LM head to the last position (graphs that declare it; older
        # ones pay it on every prompt position); LLMX_PREFILL_SESSION=eager trades the memory back.
        # An int8 KV cache is the exception: the decode graph would attend over the prompt's own
        # quantized keys/values, where the prefill graph uses them unrounded.
        if lazy_prefill is None:
            lazy_prefill = os.environ.get("LLMX_PREFILL_SESSION", "lazy") != "eager" and not manifest.kv.quantization
        self.lazy_prefill = lazy_prefill
        if not lazy_prefill:
            self.sessions["prefill"] = self._load("prefill")
        self._mapped = _MappedFiles(artifact) if low_memory else None
        kv = manifest.kv
        self.num_layers, self.kv_heads, self.head_dim = kv.num_layers, kv.num_kv_heads, kv.head_dim
        self.kv_dtype = np.dtype(kv.dtype)
        self.vocab_size = manifest.model.vocab_size
        self.past_names, self.present_names = kv.past_names(), kv.present_names()
        self._binding = self.sessions["decode"].io_binding()
        # Artifacts exported before the decode graph took logits_to_keep compute every position's logits.
        decode = self.sessions["decode"]
        self.keeps_logits = LOGITS_TO_KEEP in {i.name for i in (*decode.get_inputs(), *decode.get_overridable_initializers())}
        # As OrtValues: bind_cpu_input looks the name up among the required inputs only and refuses it.
        self._keep = {flag: _ort().OrtValue.ortvalue_from_numpy(np.array(int(flag), np.int64)) for flag in (False, True)}
        self._bound_keep: bool | None = None
        self._logits: np.ndarray | None = None
        self._bound_kv: tuple | None = None  # (cache serial, version, first row, rows) the decode binding points at
        self.prefill_calls = 0  # for tests and metrics: how often prefill ran (on either graph)

    def _load(self, name: str):
        graph = self.artifact.graph(name)
        # Graphs fresh from `llmx optimize` are fused already and say so (ort_optimization "basic").
        level = self._optimization or graph.ort_optimization or "all"
        if level == "none" and REBUILT in self.manifest.extras:
            level = "basic"  # constant folding rebuilds the block tensors stored small (llmx/compact_blocks.py)
        opts = session_options(self.cpu_plan.threads, level, self.cpu_plan.spin, prepack=not self.low_memory)
        path = self.artifact.existing_file(graph.file, f"graphs.{name}.file")
        try:
            model = self._rebuilt.prepare(path, opts) if REBUILT in self.manifest.extras else str(path)
            with huge_pages.backing(self._huge_pages):
                return _ort().InferenceSession(model, opts, providers=[self._ort_provider])
        except Exception as exc:
            raise ArtifactError(f"ONNX Runtime cannot load {graph.file}: {str(exc).splitlines()[0]}") from exc

    @property
    def max_seq_len(self) -> int:
        return self.manifest.max_seq_len

    def new_cache(self, rows: int, capacity: int) -> KVCache:
        return KVCache(self.num_layers, self.kv_heads, self.head_dim, rows, capacity, self.max_seq_len, self.kv_dtype)

    # -- prefill ---------------------------------------------------------------------------

    def prefill(self, cache: KVCache, rows: list[int], prompts: list[list[int]], padding: str = "right") -> np.ndarray:
        """Run whole prompts; write their KV into ``rows``; return last-position logits [n, V]."""
        if self._mapped is not None:
            self._mapped.check()
        self.prefill_calls += 1
        if len(prompts) == 1 and "prefill" not in self.sessions:
            if not prompts[0]:
                raise InputError("a prompt must have at least one token")
            cache.lengths[rows[0]] = 0
            return self._decode(cache, np.asarray(prompts, dtype=np.int64), rows[0], last_only=True)[:, -1]
        if "prefill" not in self.sessions:
            self.sessions["prefill"] = self._load("prefill")
        ids, mask, positions, lengths = prompt_inputs(prompts, padding)
        width = ids.shape[1]
        cache.ensure_capacity(width)
        outputs = self.sessions["prefill"].run(None, {"input_ids": ids, "attention_mask": mask, "position_ids": positions})
        logits, presents = outputs[0], outputs[1:]
        for i, (row, n) in enumerate(zip(rows, lengths)):
            span = slice(width - n, width) if padding == "left" else slice(0, n)
            cache.write(row, [p[i, :, span] for p in presents])
        if logits.shape[1] != 1:  # an artifact exported with all prefill logits
            picks = [width - 1 if padding == "left" else n - 1 for n in lengths]
            return logits[np.arange(len(prompts)), picks]
        return logits[:, 0]

    # -- decode ----------------------------------------------------------------------------

    def decode(self, cache: KVCache, input_ids: np.ndarray, last_only: bool = False) -> np.ndarray:
        """Append ``input_ids`` [n, T] to rows 0..n-1 of ``cache``; logits [n, T, V] ([n, 1, V] with
        ``last_only`` where the decode graph takes ``logits_to_keep``)."""
        if self._mapped is not None:
            self._mapped.check()
        n, t = input_ids.shape
        if n > 1 and t > 1 and self.manifest.graphs["decode"].ops == "onnxruntime":
            # GroupQueryAttention takes several new tokens per call only for a batch of one.
            return np.stack([self._decode(cache, input_ids[r : r + 1], r, last_only)[0].copy() for r in range(n)])
        return self._decode(cache, input_ids, 0, last_only)

    def _decode(self, cache: KVCache, input_ids: np.ndarray, first_row: int, last_only: bool = False) -> np.ndarray:
        n, t = input_ids.shape
        b = self._binding
        bind_decode_inputs(b, cache, input_ids, first_row)
        kept = 1 if last_only and self.keeps_logits else t
        if self.keeps_logits and self._bound_keep is not last_only:
            # Bindings persist: a step after a last-only prefill must feed 0 (all positions) again.
            b.bind_ortvalue_input(LOGITS_TO_KEEP, self._keep[last_only])
            self._bound_keep = last_only
        # Bindings persist between runs: rebind the 2 x layers KV buffers only when they changed.
        # The key names the cache without holding it: an ended batch's KV (hundreds of MB after a
        # long request) is freed at once, and the stale pointers are never run, since a new cache
        # has a new serial.
        key = (cache.serial, cache.version, first_row, n)
        if self._bound_kv != key:
            shape = (n, self.kv_heads, cache.capacity, self.head_dim)
            for past, present, buf in zip(self.past_names, self.present_names, cache.buffers):
                ptr = buf.ctypes.data + first_row * buf[0].nbytes  # rows first_row.. are contiguous
                b.bind_input(past, "cpu", 0, self.kv_dtype, shape, ptr)
                b.bind_output(present, "cpu", 0, self.kv_dtype, shape, ptr)
            self._bound_kv = key
        if self._logits is None or self._logits.shape != (n, kept, self.vocab_size):
            self._logits = np.empty((n, kept, self.vocab_size), np.float32)
            b.bind_output("logits", "cpu", 0, np.float32, self._logits.shape, self._logits.ctypes.data)
        # The lengths move before the run, next to the other small numpy work: right after a run
        # has streamed the weights through the caches, one cold ufunc call costs ~40 us.
        filled = cache.lengths[first_row : first_row + n]
        filled += t
        try:
            self.sessions["decode"].run_with_iobinding(b)
        except BaseException:
            filled -= t
            raise
        return self._logits
