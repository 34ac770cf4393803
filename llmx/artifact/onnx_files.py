"""Saving and describing ONNX graphs in an artifact (needs the ``onnx`` package).

All graphs of an artifact keep their large initializers in one ``weights.bin``: prefill and
decode hold the same weights, so each tensor is stored once and both graphs point at it.
Large tensors start on 64 KiB boundaries so ONNX Runtime can memory-map them.
"""

from __future__ import annotations

import hashlib
import queue
import threading
from pathlib import Path

import numpy as np

from llmx.artifact.manifest import GraphSpec, TensorSpec

IR_VERSION = 10  # ONNX Runtime 1.2x-1.31 and TensorRT 10 read it; onnx 1.23 would write 14
WEIGHTS_FILE = "weights.bin"
_INLINE_LIMIT = 1024  # bytes: smaller tensors stay inside the graph
_ALIGN_LARGE, _ALIGN = 1 << 16, 64
_QUEUED = 2  # tensors waiting for the background writer: bounds what a streamed export holds
_QUEUED_BYTES = 256 << 20  # larger ones (an 8B model's 2 GB embedding) are written in the exporting thread


def _onnx():
    from llmx.errors import require

    return require("onnx", "writing ONNX graphs", "export")


def tensor_bytes(init, base_dir: Path | None) -> bytes:
    """An initializer's raw bytes, read from ``base_dir``'s file when stored outside the graph."""
    onnx = _onnx()
    if init.data_location == onnx.TensorProto.EXTERNAL:
        info = {e.key: e.value for e in init.external_data}
        with open(Path(base_dir) / info["location"], "rb") as f:
            f.seek(int(info.get("offset", 0)))
            return f.read(int(info["length"])) if "length" in info else f.read()
    if init.HasField("raw_data"):
        return init.raw_data
    return onnx.numpy_helper.to_array(init).tobytes()


class WeightsFile:
    """The artifact's ``weights.bin``, appended to one tensor at a time.

    Through ``store`` a tensor of the same name and content is stored once; large tensors start
    on 64 KiB boundaries (ONNX Runtime memory-maps them), small ones on 64 bytes.

    With ``background`` the writes happen on a thread of their own (at most ``_QUEUED`` tensors
    waiting), so a streamed export converts or quantizes the next weight while the disk takes
    the last one; offsets are known at ``append`` time either way.
    """

    inline_limit = _INLINE_LIMIT

    def __init__(self, out_dir: Path, mode: str = "wb", background: bool = False, name: str = WEIGHTS_FILE):
        self.name = name  # the file's name in the graphs' external-data references
        self.file = open(Path(out_dir) / name, mode)
        self.file.seek(0, 2)
        self.position = self.file.tell()
        self.written: dict[tuple[str, str], tuple[int, int]] = {}
        self._queue: queue.Queue | None = None
        self._error: BaseException | None = None
        if background:
            self._queue = queue.Queue(maxsize=_QUEUED)
            self._writer = threading.Thread(target=self._write_queued, name="weights.bin writer", daemon=True)
            self._writer.start()

    def __enter__(self) -> "WeightsFile":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        # Ended by an exception the file is abandoned, and the queue is not touched: a signal's
        # exception (Ctrl-C, Terminated) can land in Queue.put between taking the queue's lock and
        # the `with` that releases it, so a put or join here could wait forever. The writer is a
        # daemon; a write after the close below fails into its unread _error.
        try:
            if self._queue is not None and exc_type is None:
                self._queue.put(None)
                self._writer.join()
                self._raise_writer_error()
        finally:
            self.file.close()

    def append(self, raw: bytes | memoryview) -> tuple[int, int]:
        """Write ``raw`` at the next aligned offset; returns (offset, length)."""
        align = _ALIGN_LARGE if len(raw) >= (1 << 20) else _ALIGN
        padding = -self.position % align
        offset = self.position + padding
        self.position = offset + len(raw)
        now = self._queue is None or len(raw) > _QUEUED_BYTES
        if now and self._queue is not None:
            self._queue.join()  # the writer is idle: a tensor this big is written now, not held while the next is made
        self._raise_writer_error()
        if now:
            self.file.write(b"\0" * padding)
            self.file.write(raw)
        else:
            self._queue.put((padding, raw))
        return offset, len(raw)

    def _write_queued(self) -> None:
        while (item := self._queue.get()) is not None:
            if self._error is None:
                try:
                    self.file.write(b"\0" * item[0])
                    self.file.write(item[1])
                except BaseException as exc:  # raised in the exporting thread at its next append or at close
                    self._error = exc
            self._queue.task_done()

    def _raise_writer_error(self) -> None:
        if self._error is not None:
            raise self._error

    def store(self, init, raw: bytes | memoryview) -> None:
        """Make initializer ``init`` hold ``raw``: inline if small, else a reference into this file."""
        onnx = _onnx()
        if len(raw) <= self.inline_limit:
            if init.data_location == onnx.TensorProto.EXTERNAL:
                del init.external_data[:]
                init.data_location = onnx.TensorProto.DEFAULT
                init.raw_data = bytes(raw)
            return
        key = (init.name, hashlib.sha1(raw).hexdigest())
        if key not in self.written:
            self.written[key] = self.append(raw)
        offset, length = self.written[key]
        init.ClearField("raw_data")
        for field in ("float_data", "int32_data", "int64_data", "double_data", "uint64_data", "string_data"):
            init.ClearField(field)
        external_reference(init, offset, length, self.name)

    def tensor(self, name: str, array: np.ndarray) -> "onnx.TensorProto":
        """A new initializer ``name`` holding ``array`` as ``store`` keeps it. Made from the array's
        bytes, never through ``numpy_helper.from_array``: a protobuf message keeps the memory of a
        field it cleared until the message itself goes, so a reference made by clearing raw_data
        holds the whole tensor (an 8B model's w4 blocks: 3.9 GB kept by the search)."""
        onnx = _onnx()
        array = np.ascontiguousarray(array)
        init = onnx.TensorProto()
        init.name, init.data_type = name, onnx.helper.np_dtype_to_tensor_dtype(array.dtype)
        init.dims.extend(array.shape)
        if array.nbytes <= self.inline_limit:
            init.raw_data = array.tobytes()
        else:
            self.store(init, memoryview(array).cast("B"))
        return init


def external_reference(init, offset: int, length: int, location: str = WEIGHTS_FILE) -> None:
    """Point initializer ``init`` at ``length`` bytes of the artifact's weights.bin (or the file
    ``location`` beside the graph) from ``offset``."""
    onnx = _onnx()
    del init.external_data[:]
    init.data_location = onnx.TensorProto.EXTERNAL
    for k, v in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = init.external_data.add()
        entry.key, entry.value = k, v


def save_graphs(graphs: dict[str, "onnx.ModelProto"], out_dir: Path, sources: dict[str, Path] | None = None,
                append: bool = False, keep: set[str] = frozenset()) -> None:
    """Write ``{name}.onnx`` for each graph with large tensors in one shared ``weights.bin``.

    ``sources`` gives, per graph, the directory its external data currently lives in (for
    graphs loaded with ``load_external_data=False``); tensors of the same name and content are
    written once. With ``append``, ``out_dir``'s weights.bin already holds tensors the graphs
    reference (a streamed export wrote them there); they stay, and the rest is added after them.
    Tensors named in ``keep`` keep their references as they are (the caller made them valid).
    """
    onnx = _onnx()
    out_dir = Path(out_dir)
    sources = sources or {}
    with WeightsFile(out_dir, "ab" if append else "wb") as data:
        for name, model in graphs.items():
            for init in model.graph.initializer:
                if (append and stored_in(init)) or init.name in keep:
                    continue
                data.store(init, tensor_bytes(init, sources.get(name)))
            model.ir_version = IR_VERSION
            onnx.save_model(model, str(out_dir / f"{name}.onnx"))


def stored_in(init, location: str = WEIGHTS_FILE) -> bool:
    """Whether initializer ``init`` references the file ``location`` beside its graph."""
    return any(e.key == "location" and e.value == location for e in init.external_data)


def stored_bytes(init) -> int:
    """Bytes of initializer ``init``'s values, without reading them: its external length, its inline
    bytes, else its dims times its type's size (a reference written without a length)."""
    onnx = _onnx()
    info = {e.key: e.value for e in init.external_data}
    if "length" in info:
        return int(info["length"])
    if init.raw_data:
        return len(init.raw_data)
    itemsize = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(init.data_type)).itemsize
    return int(np.prod(init.dims, dtype=np.int64)) * itemsize


def load_graph(path: Path, with_weights: bool = False) -> "onnx.ModelProto":
    onnx = _onnx()
    return onnx.load_model(str(path), load_external_data=with_weights)


def _dtype_name(elem_type: int) -> str:
    onnx = _onnx()
    return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type)).name


def _shape(value_info) -> list[int | str]:
    dims = value_info.type.tensor_type.shape.dim
    return [d.dim_param if d.dim_param else (d.dim_value if d.HasField("dim_value") else "?") for d in dims]


def describe_graph(model: "onnx.ModelProto", file: str, ops: str = "portable") -> GraphSpec:
    def spec(v) -> TensorSpec:
        return TensorSpec(v.name, _dtype_name(v.type.tensor_type.elem_type), _shape(v))

    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    external = sorted(
        {e.value for i in model.graph.initializer for e in i.external_data if e.key == "location"}
    )
    return GraphSpec(
        file=file,
        inputs=[spec(v) for v in model.graph.input],
        outputs=[spec(v) for v in model.graph.output],
        opset=opset,
        ops=ops,
        external_data=external,
    )
