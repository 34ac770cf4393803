"""Stand-ins for CUDA and TensorRT so the GPU backends' own logic runs in CPU CI.

What is real: everything in llmx (engine loading and compatibility checks, profiles, tensor
binding by address, device KV cache and its strided copies, input packing, prefill into rows,
CUDA-graph capture/replay bookkeeping). What is fake:

- ``HostDevice``: llmx.cuda.CudaDevice's methods over host memory. Pointers are real
  addresses of 256-byte-aligned numpy buffers; every access is bounds-checked against live
  allocations, memory from ``alloc(zero=False)`` is filled with 0xFF (NaN as float), and
  stream capture records the enqueued work so ``launch`` replays it.
- a ``tensorrt`` module whose "engine" is the ONNX graph it was built from plus its profiles:
  ``set_input_shape`` refuses shapes outside the profile, ``set_tensor_address`` refuses
  unaligned addresses, and ``execute_async_v3`` reads the inputs from the bound addresses,
  runs ONNX Runtime CPU and writes the outputs to the bound addresses (inputs are read
  before outputs are written, i.e. an in-place past/present update behaves as intended).
- ``FakeBuilder``: writes such engines, standing in for Polygraphy + TensorRT.

It cannot show that real TensorRT computes the right numbers, accepts aliased past/present
buffers, or captures graphs: the ``gpu``-marked tests do that on a GPU.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import types
from pathlib import Path

import numpy as np

ALIGN = 256
MAGIC = b"LLMX-FAKE-TRT\n"
STREAMS: dict[int, "HostDevice"] = {}
_ids = itertools.count(1)
TRT_NAMES = {"float32": "FLOAT", "float16": "HALF", "bfloat16": "BF16", "int64": "INT64", "int32": "INT32"}
ORT_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64, "tensor(int32)": np.int32}


class HostDevice:
    def __init__(self, name: str = "Fake GPU (host memory)", compute_capability: str = "8.9"):
        self.name, self.cc = name, compute_capability
        self.allocations: dict[int, tuple[np.ndarray, int]] = {}
        self.stream = next(_ids)
        STREAMS[self.stream] = self
        self.capturing: list | None = None
        self.graphs: dict[int, list] = {}
        self.launches = 0

    def record(self) -> dict:
        return {"name": self.name, "compute_capability": self.cc, "memory_bytes": 1 << 34}

    # -- memory ----------------------------------------------------------------------------

    def alloc(self, nbytes: int, zero: bool = True) -> int:
        raw = np.zeros(nbytes + ALIGN, np.uint8) if zero else np.full(nbytes + ALIGN, 0xFF, np.uint8)
        ptr = -(-raw.ctypes.data // ALIGN) * ALIGN
        self.allocations[ptr] = (raw, nbytes)
        return ptr

    def free(self, ptr: int) -> None:
        assert ptr in self.allocations, f"free of {ptr:#x}, which is not allocated"
        del self.allocations[ptr]

    def check(self, ptr: int, nbytes: int) -> None:
        for base, (_, size) in self.allocations.items():
            if base <= ptr and ptr + nbytes <= base + size:
                return
        raise AssertionError(f"device access [{ptr:#x}, +{nbytes}) is outside every live allocation")

    def memset(self, ptr: int, nbytes: int, value: int = 0) -> None:
        self.check(ptr, nbytes)
        ctypes.memset(ptr, value, nbytes)

    def upload(self, ptr: int, array: np.ndarray) -> None:
        assert self.capturing is None, "host->device copy while capturing a graph"
        array = np.ascontiguousarray(array)
        self.check(ptr, array.nbytes)
        ctypes.memmove(ptr, array.ctypes.data, array.nbytes)

    def download(self, array: np.ndarray, ptr: int) -> np.ndarray:
        assert array.flags["C_CONTIGUOUS"]
        self.check(ptr, array.nbytes)
        ctypes.memmove(array.ctypes.data, ptr, array.nbytes)
        return array

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        self.check(dst, nbytes)
        self.check(src, nbytes)
        ctypes.memmove(dst, src, nbytes)

    def copy_2d(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, kind: int = 3) -> None:
        assert width <= dpitch and width <= spitch, "2-D copy rows overlap"
        for r in range(height):
            if kind in (1, 3):  # to device
                self.check(dst + r * dpitch, width)
            if kind in (2, 3):  # from device
                self.check(src + r * spitch, width)
            ctypes.memmove(dst + r * dpitch, src + r * spitch, width)

    def synchronize(self) -> None:
        pass

    # -- graphs ----------------------------------------------------------------------------

    def enqueue(self, work) -> None:
        if self.capturing is not None:
            self.capturing.append(work)
        else:
            work()

    def begin_capture(self) -> None:
        assert self.capturing is None
        self.capturing = []

    def end_capture(self) -> int:
        handle, self.graphs[handle] = next(_ids), self.capturing
        self.capturing = None
        return handle

    def launch(self, graph: int) -> None:
        self.launches += 1
        for work in self.graphs[graph]:
            work()

    def destroy_graph(self, graph: int) -> None:
        self.graphs.pop(graph)


# -- a tensorrt module whose engines run on ONNX Runtime CPU ----------------------------------------


class FakeEngine:
    def __init__(self, data: bytes):
        import onnxruntime as ort

        assert data.startswith(MAGIC), "not a fake engine"
        header, model = data[len(MAGIC):].split(b"\n", 1)
        self.profiles = json.loads(header)["profiles"]
        self.session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
        self.inputs = {i.name: np.dtype(ORT_TYPES[i.type]) for i in self.session.get_inputs()}
        self.outputs = {o.name: np.dtype(ORT_TYPES[o.type]) for o in self.session.get_outputs()}
        self.names = [*self.inputs, *self.outputs]

    num_optimization_profiles = property(lambda self: len(self.profiles))
    num_io_tensors = property(lambda self: len(self.names))

    def get_tensor_name(self, i: int) -> str:
        return self.names[i]

    def get_tensor_mode(self, name: str) -> str:
        return "INPUT" if name in self.inputs else "OUTPUT"

    def get_tensor_dtype(self, name: str):
        dtype = self.inputs.get(name, self.outputs.get(name))
        return types.SimpleNamespace(name=TRT_NAMES[dtype.name])

    def get_tensor_profile_shape(self, name: str, profile: int):
        return self.profiles[profile]["shapes"][name]

    def create_execution_context(self) -> "FakeContext":
        return FakeContext(self)


class FakeContext:
    def __init__(self, engine: FakeEngine):
        self.engine, self.profile = engine, None
        self.shapes: dict[str, tuple] = {}
        self.addresses: dict[str, int] = {}
        self.executions = 0

    def set_optimization_profile_async(self, profile: int, stream: int) -> bool:
        if profile >= self.engine.num_optimization_profiles:
            return False
        self.profile = profile
        return True

    def set_input_shape(self, name: str, shape) -> bool:
        lo, _, hi = self.engine.get_tensor_profile_shape(name, self.profile)
        shape = tuple(int(s) for s in shape)
        if len(shape) != len(lo) or any(not a <= s <= b for s, a, b in zip(shape, lo, hi)):
            return False
        self.shapes[name] = shape
        return True

    def set_tensor_address(self, name: str, ptr: int) -> bool:
        if not ptr or ptr % ALIGN or name not in self.engine.names:
            return False
        self.addresses[name] = ptr
        return True

    def execute_async_v3(self, stream: int) -> bool:
        if any(n not in self.shapes for n in self.engine.inputs) or any(n not in self.addresses for n in self.engine.names):
            return False
        shapes, addresses, device = dict(self.shapes), dict(self.addresses), STREAMS[stream]
        device.enqueue(lambda: self._run(device, shapes, addresses))  # captured work keeps these bindings
        self.executions += 1
        return True

    def _run(self, device: HostDevice, shapes: dict, addresses: dict) -> None:
        feeds = {}
        for name, dtype in self.engine.inputs.items():
            feeds[name] = np.empty(shapes[name], dtype)
            device.check(addresses[name], feeds[name].nbytes)
            ctypes.memmove(feeds[name].ctypes.data, addresses[name], feeds[name].nbytes)
        for (name, dtype), value in zip(self.engine.outputs.items(), self.engine.session.run(None, feeds)):
            value = np.ascontiguousarray(value, dtype)
            device.check(addresses[name], value.nbytes)
            ctypes.memmove(addresses[name], value.ctypes.data, value.nbytes)


def make_fake_tensorrt(version: str = "10.99.0") -> types.ModuleType:
    trt = types.ModuleType("tensorrt")
    trt.__version__ = version
    trt.TensorIOMode = types.SimpleNamespace(INPUT="INPUT", OUTPUT="OUTPUT")
    trt.Logger = type("Logger", (), {"WARNING": 2, "__init__": lambda self, severity=2: None})
    trt.Runtime = type("Runtime", (), {"__init__": lambda self, logger: None,
                                      "deserialize_cuda_engine": lambda self, data: FakeEngine(bytes(data))})
    return trt


class FakeBuilder:
    """engine.tensorrt.EngineBuilder that writes fake engines (the ONNX graph + profiles)."""

    def __init__(self, device: dict | None = None, version: str = "10.99.0"):
        self.device = device or HostDevice().record()
        self.version, self.major = version, int(version.split(".")[0])
        self.built: list[str] = []

    def build(self, onnx_path: Path, engine_path: Path, spec, plan, log) -> dict:
        import onnx

        model = onnx.load(str(onnx_path))  # with its external weights, as TensorRT parses from the path
        header = json.dumps({"profiles": [p.to_dict() for p in spec.profiles]}).encode()
        engine_path.write_bytes(MAGIC + header + b"\n" + model.SerializeToString())
        self.built.append(spec.name)
        return {"bytes": engine_path.stat().st_size}

    def timing_cache_record(self) -> dict:
        return {"path": None, "reused": False, "bytes": 0}
