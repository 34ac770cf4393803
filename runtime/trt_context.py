"""One TensorRT execution context pinned to one optimization profile, with CUDA-graph replay.

``run(shapes, addresses)`` sets input shapes and tensor addresses (only those that changed:
each is a call into TensorRT) and enqueues the engine on the device's stream. With
``graph=True`` the first run of a (shapes, addresses) key executes normally (TensorRT needs
one enqueue after a shape change before it can be captured) and is then captured into a CUDA
graph; later runs with the same key replay it: one launch instead of hundreds of kernel
launches from Python. A failed capture turns graphs off for this context and says so once.
"""

from __future__ import annotations

import sys
from collections import OrderedDict

from llmx.cuda import CudaError
from llmx.errors import InputError, LlmxError

MAX_GRAPHS = 16  # captured graphs kept per context (one per batch size / cache size seen)


def io_names(trt, engine) -> tuple[list[str], list[str]]:
    names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
    inputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
    return inputs, [n for n in names if n not in inputs]


class TrtContext:
    def __init__(self, trt, engine, profile: int, device, label: str):
        self.device, self.label, self.profile = device, label, profile
        if profile >= engine.num_optimization_profiles:
            raise LlmxError(f"{label}: engine has {engine.num_optimization_profiles} profile(s), needs profile {profile}")
        self.context = engine.create_execution_context()
        if self.context is None:
            raise LlmxError(f"{label}: TensorRT could not create an execution context (out of GPU memory?)")
        if not self.context.set_optimization_profile_async(profile, device.stream):
            raise LlmxError(f"{label}: TensorRT refused optimization profile {profile}")
        device.synchronize()
        self.inputs, self.outputs = io_names(trt, engine)
        self.ranges = {n: [tuple(s) for s in engine.get_tensor_profile_shape(n, profile)] for n in self.inputs}
        self.graphs: OrderedDict[tuple, int] = OrderedDict()
        self.use_graphs = True
        self._shapes: dict[str, tuple] = {}
        self._addresses: dict[str, int] = {}
        self.executions = self.replays = 0  # for tests and metrics

    def check_shapes(self, shapes: dict[str, tuple]) -> None:
        """Refuse shapes outside the profile with a message naming the limit (not TensorRT's)."""
        for name, shape in shapes.items():
            lo, _, hi = self.ranges[name]
            for axis, (n, a, b) in enumerate(zip(shape, lo, hi)):
                if not a <= n <= b:
                    raise InputError(
                        f"{self.label}: {name} axis {axis} is {n}, the engine was built for {a}..{b} "
                        "(rebuild with larger --max-batch / --max-seq-len / --max-decode-tokens)"
                    )

    def _bind(self, shapes: dict[str, tuple], addresses: dict[str, int]) -> None:
        for name, shape in shapes.items():
            if self._shapes.get(name) != shape:
                if not self.context.set_input_shape(name, shape):
                    raise LlmxError(f"{self.label}: TensorRT refused shape {shape} for {name}")
                self._shapes[name] = shape
        for name, ptr in addresses.items():
            if self._addresses.get(name) != ptr:
                if not self.context.set_tensor_address(name, ptr):
                    raise LlmxError(f"{self.label}: TensorRT refused the address of {name}")
                self._addresses[name] = ptr

    def run(self, shapes: dict[str, tuple], addresses: dict[str, int], graph: bool = False) -> None:
        key = (tuple(sorted(shapes.items())), tuple(sorted(addresses.items())))
        if graph and key in self.graphs:
            self._bind(shapes, addresses)  # keep the context's host-side state equal to the graph's
            self.graphs.move_to_end(key)
            self.device.launch(self.graphs[key])
            self.replays += 1
            return
        self.check_shapes(shapes)
        missing = [n for n in (*self.inputs, *self.outputs) if n not in addresses and n not in self._addresses]
        if missing:
            raise LlmxError(f"{self.label}: no buffer bound for {', '.join(missing)}")
        self._bind(shapes, addresses)
        if not self.context.execute_async_v3(self.device.stream):
            raise LlmxError(f"{self.label}: TensorRT execution failed (see TensorRT's messages above)")
        self.executions += 1
        if graph and self.use_graphs:
            self._capture(key)

    def _capture(self, key: tuple) -> None:
        try:
            self.device.begin_capture()
            try:
                ok = self.context.execute_async_v3(self.device.stream)
            finally:
                exe = self.device.end_capture()
        except CudaError as exc:
            self.use_graphs = False
            print(f"warning: {self.label}: CUDA graph capture failed, running without graphs ({exc})", file=sys.stderr)
            return
        if not ok:
            self.device.destroy_graph(exe)
            self.use_graphs = False
            return
        self.graphs[key] = exe
        while len(self.graphs) > MAX_GRAPHS:
            _, old = self.graphs.popitem(last=False)
            self.device.destroy_graph(old)

    def close(self) -> None:
        for exe in self.graphs.values():
            self.device.destroy_graph(exe)
        self.graphs.clear()
