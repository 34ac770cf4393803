"""The CUDA runtime calls llmx's GPU paths need, through the libcudart Polygraphy finds.

Polygraphy (already needed to build engines) locates libcudart, including the one pip's
``nvidia-cuda-runtime`` wheels ship, and wraps malloc, memcpy and streams. The few other calls
llmx needs (2-D copies, memset, stream capture into CUDA graphs, device properties) go through
the same ctypes handle. Nothing here imports at module load: a CPU-only install never touches
CUDA, and every failure is one LlmxError that says what is missing.

``CudaDevice`` is the whole interface the GPU backends use; tests substitute a host-memory
implementation of the same methods.
"""

from __future__ import annotations

import contextlib
import ctypes
import io

import numpy as np

from llmx.errors import InputError, LlmxError

H2D, D2H, D2D = 1, 2, 3  # cudaMemcpyKind
_CAPTURE_THREAD_LOCAL = 1  # cudaStreamCaptureModeThreadLocal: other threads may keep allocating
_ATTR_CC_MAJOR, _ATTR_CC_MINOR = 75, 76  # cudaDevAttrComputeCapabilityMajor / Minor
ALIGN = 256  # TensorRT wants tensor addresses 256-byte aligned; cudaMalloc gives at least that


class CudaError(LlmxError):
    """A CUDA runtime call failed."""


def _libcudart():
    from llmx.errors import require

    require("polygraphy", "GPU backends (to find the CUDA runtime)", "gpu")
    from polygraphy import cuda
    from polygraphy.logger import G_LOGGER

    try:  # Polygraphy prints a warning to stdout when it has to guess the library's name
        with G_LOGGER.verbosity(G_LOGGER.CRITICAL), contextlib.redirect_stdout(io.StringIO()):
            lib = cuda.wrapper().handle
    except OSError as exc:
        raise LlmxError(f"no CUDA runtime found (libcudart): {exc}; GPU backends need an NVIDIA driver and CUDA 12+") from exc
    lib.cudaGetErrorString.restype = ctypes.c_char_p
    return lib


def _p(value: int) -> ctypes.c_void_p:
    return ctypes.c_void_p(value)


class CudaDevice:
    """One GPU and one stream: allocations, copies, CUDA-graph capture, device facts."""

    def __init__(self, index: int = 0):
        self.lib = _libcudart()
        count = ctypes.c_int(0)
        err = self.lib.cudaGetDeviceCount(ctypes.byref(count))
        if err != 0 or count.value == 0:
            reason = self._error_string(err) if err else "no devices"
            raise LlmxError(f"no CUDA GPU is visible ({reason}); use --backend ort-cpu on this machine")
        if not 0 <= index < count.value:
            raise InputError(f"GPU index {index} is out of range: {count.value} visible")
        self.index = index
        self._check(self.lib.cudaSetDevice(ctypes.c_int(index)), "cudaSetDevice")
        stream = ctypes.c_void_p()
        self._check(self.lib.cudaStreamCreate(ctypes.byref(stream)), "cudaStreamCreate")
        self.stream = stream.value or 0

    def _error_string(self, err: int) -> str:
        return (self.lib.cudaGetErrorString(ctypes.c_int(err)) or b"?").decode()

    def _check(self, err: int, what: str) -> None:
        if err != 0:
            raise CudaError(f"{what} failed: {self._error_string(err)} (CUDA error {err})")

    # -- memory ----------------------------------------------------------------------------

    def alloc(self, nbytes: int, zero: bool = True) -> int:
        ptr = ctypes.c_void_p()
        self._check(self.lib.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(max(nbytes, 1))), f"cudaMalloc({nbytes})")
        if zero:
            self.memset(ptr.value, nbytes)
        return ptr.value

    def free(self, ptr: int) -> None:
        self._check(self.lib.cudaFree(_p(ptr)), "cudaFree")

    def memset(self, ptr: int, nbytes: int, value: int = 0) -> None:
        self._check(self.lib.cudaMemsetAsync(_p(ptr), ctypes.c_int(value), ctypes.c_size_t(nbytes), _p(self.stream)), "cudaMemsetAsync")

    def upload(self, ptr: int, array: np.ndarray) -> None:
        """Host -> device on the stream. Pageable memory is staged before this returns."""
        array = np.ascontiguousarray(array)
        self._copy(ptr, array.ctypes.data, array.nbytes, H2D)

    def download(self, array: np.ndarray, ptr: int) -> np.ndarray:
        """Device -> host into ``array`` (contiguous), waiting for the stream."""
        self._copy(array.ctypes.data, ptr, array.nbytes, D2H)
        self.synchronize()
        return array

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        self._copy(dst, src, nbytes, D2D)

    def _copy(self, dst: int, src: int, nbytes: int, kind: int) -> None:
        if nbytes:
            err = self.lib.cudaMemcpyAsync(_p(dst), _p(src), ctypes.c_size_t(nbytes), ctypes.c_int(kind), _p(self.stream))
            self._check(err, "cudaMemcpyAsync")

    def copy_2d(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, kind: int = D2D) -> None:
        """``height`` rows of ``width`` bytes; rows start every ``spitch`` / ``dpitch`` bytes."""
        if width and height:
            err = self.lib.cudaMemcpy2DAsync(_p(dst), ctypes.c_size_t(dpitch), _p(src), ctypes.c_size_t(spitch),
                                             ctypes.c_size_t(width), ctypes.c_size_t(height), ctypes.c_int(kind), _p(self.stream))
            self._check(err, "cudaMemcpy2DAsync")

    def synchronize(self) -> None:
        self._check(self.lib.cudaStreamSynchronize(_p(self.stream)), "cudaStreamSynchronize")

    # -- CUDA graphs -----------------------------------------------------------------------

    def begin_capture(self) -> None:
        self._check(self.lib.cudaStreamBeginCapture(_p(self.stream), ctypes.c_int(_CAPTURE_THREAD_LOCAL)), "cudaStreamBeginCapture")

    def end_capture(self) -> int:
        """Stop capturing; returns an instantiated graph to ``launch``."""
        graph, exe = ctypes.c_void_p(), ctypes.c_void_p()
        self._check(self.lib.cudaStreamEndCapture(_p(self.stream), ctypes.byref(graph)), "cudaStreamEndCapture")
        try:
            err = self.lib.cudaGraphInstantiateWithFlags(ctypes.byref(exe), graph, ctypes.c_ulonglong(0))
            self._check(err, "cudaGraphInstantiateWithFlags")
        finally:
            self.lib.cudaGraphDestroy(graph)
        return exe.value

    def launch(self, graph: int) -> None:
        self._check(self.lib.cudaGraphLaunch(_p(graph), _p(self.stream)), "cudaGraphLaunch")

    def destroy_graph(self, graph: int) -> None:
        self.lib.cudaGraphExecDestroy(_p(graph))

    # -- facts -----------------------------------------------------------------------------

    def record(self) -> dict:
        """Name, compute capability and memory: what an engine is tied to."""
        props = ctypes.create_string_buffer(4096)  # cudaDeviceProp starts with char name[256]
        get = getattr(self.lib, "cudaGetDeviceProperties_v2", None) or self.lib.cudaGetDeviceProperties
        self._check(get(props, ctypes.c_int(self.index)), "cudaGetDeviceProperties")
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(self.lib.cudaDeviceGetAttribute(ctypes.byref(major), ctypes.c_int(_ATTR_CC_MAJOR), ctypes.c_int(self.index)), "cudaDeviceGetAttribute")
        self._check(self.lib.cudaDeviceGetAttribute(ctypes.byref(minor), ctypes.c_int(_ATTR_CC_MINOR), ctypes.c_int(self.index)), "cudaDeviceGetAttribute")
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        self._check(self.lib.cudaMemGetInfo(ctypes.byref(free), ctypes.byref(total)), "cudaMemGetInfo")
        name = props.raw[:256].split(b"\0", 1)[0].decode(errors="replace")
        return {"name": name, "compute_capability": f"{major.value}.{minor.value}", "memory_bytes": total.value}


def open_device(index: int = 0) -> CudaDevice:
    return CudaDevice(index)
