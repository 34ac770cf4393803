"""Building one engine with Polygraphy's loaders (needs TensorRT and a GPU):

    NetworkFromOnnxPath(graph)            parsed from the file, so external weights are found
      -> CreateConfig(profiles, memory pool limit, timing cache, progress monitor)
      -> EngineFromNetwork(..., save_timing_cache) -> SaveEngine

TensorRT 11 has no precision flags: the network is strongly typed and precision comes from
the graph (llmx/low_precision.py, Q/DQ). On TensorRT 10 the same strongly typed build is
used, except for INT8 from a calibration table, which is TensorRT 10's weakly typed mode
(INT8 + FP16 flags, per-tensor dynamic ranges set from the table).

The timing cache is shared by every build on the same TensorRT version and GPU architecture
(under llmx's cache directory unless ``--timing-cache`` says otherwise) and updated after each
engine, so later builds skip most tactic timing.
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path

from llmx.cuda import open_device
from llmx.engine.trt_profiles import EngineSpec
from llmx.engine.trt_records import default_timing_cache, major_version, read_calibration_table
from llmx.artifact.tensorrt import TENSORRT_HINT, ProfileSpec
from llmx.errors import LlmxError, require


class BuildProgress:
    """Turns TensorRT's IProgressMonitor callbacks into a few readable lines (top two levels)."""

    def __init__(self, log, max_depth: int = 1):
        self.log, self.max_depth = log, max_depth
        self.depth: dict[str, int] = {}
        self.started: dict[str, float] = {}

    def phase_start(self, phase: str, parent: str | None, steps: int) -> None:
        depth = self.depth.get(parent, -1) + 1 if parent else 0
        self.depth[phase], self.started[phase] = depth, time.monotonic()
        if depth <= self.max_depth:
            self.log(f"{'  ' * (depth + 1)}{phase}" + (f" ({steps} steps)" if steps > 1 else ""))

    def step_complete(self, phase: str, step: int) -> bool:
        return True  # False would cancel the build

    def phase_finish(self, phase: str) -> None:
        depth = self.depth.pop(phase, 0)
        elapsed = time.monotonic() - self.started.pop(phase, time.monotonic())
        if depth == 0:
            self.log(f"  {phase}: done in {elapsed:.1f} s")


def progress_monitor(trt, progress: BuildProgress):
    """A trt.IProgressMonitor that forwards to ``progress`` (the class needs TensorRT to exist)."""

    class Monitor(trt.IProgressMonitor):
        def __init__(self):
            trt.IProgressMonitor.__init__(self)

        def phase_start(self, phase_name, parent_phase, num_steps):
            progress.phase_start(phase_name, parent_phase, num_steps)

        def step_complete(self, phase_name, step):
            return progress.step_complete(phase_name, step)

        def phase_finish(self, phase_name):
            progress.phase_finish(phase_name)

    return Monitor()


def polygraphy_profile(profile: ProfileSpec):
    from polygraphy.backend.trt import Profile

    result = Profile()
    for name, (lo, opt, hi) in profile.shapes.items():
        result.add(name, min=lo, opt=opt, max=hi)
    return result


def set_dynamic_ranges(network, ranges: dict[str, float]) -> int:
    """TensorRT 10 implicit INT8: each named tensor's range is [-amax, amax]. Returns how many were set."""
    tensors = [network.get_input(i) for i in range(network.num_inputs)]
    tensors += [layer.get_output(j) for layer in network for j in range(layer.num_outputs)]
    count = 0
    for tensor in tensors:
        amax = ranges.get(tensor.name)
        if amax:
            tensor.set_dynamic_range(-amax, amax)
            count += 1
    return count


class PolygraphyBuilder:
    """The real EngineBuilder (see engine/tensorrt.py): TensorRT via Polygraphy on one GPU."""

    def __init__(self, timing_cache: str | Path | None = None, workspace_bytes: int | None = None,
                 opt_level: int | None = None, device_index: int = 0):
        self.trt = require("tensorrt", "llmx build", hint=TENSORRT_HINT, name="TensorRT")
        require("polygraphy", "llmx build", "tensorrt")
        self.device = open_device(device_index).record()
        self.version = self.trt.__version__
        self.major = major_version(self.version)
        self.timing_cache = Path(timing_cache) if timing_cache else default_timing_cache(self.version, self.device)
        self.cache_existed = self.timing_cache.is_file()
        self.workspace_bytes, self.opt_level = workspace_bytes, opt_level

    def timing_cache_record(self) -> dict:
        size = self.timing_cache.stat().st_size if self.timing_cache.is_file() else 0
        return {"path": str(self.timing_cache), "reused": self.cache_existed, "bytes": size}

    def build(self, onnx_path: Path, engine_path: Path, spec: EngineSpec, plan, log) -> dict:
        from polygraphy.backend.trt import CreateConfig, EngineFromNetwork, NetworkFromOnnxPath, PostprocessNetwork, SaveEngine
        from polygraphy.exception import PolygraphyException
        from polygraphy.logger import G_LOGGER

        trt = self.trt
        # TensorRT 11 networks are always strongly typed (and the flag's number changed): ask only on 10.
        typed = {"strongly_typed": True} if plan.strongly_typed and self.major < 11 else {}
        network = NetworkFromOnnxPath(str(onnx_path), **typed)
        weak = {}
        if plan.int8_source == "calibration_table":
            ranges = read_calibration_table(engine_path.parent / plan.calibration_table)
            network = PostprocessNetwork(network, lambda network: log(f"  INT8 ranges for {set_dynamic_ranges(network, ranges)} tensors"),
                                         name="llmx-int8-ranges")
            weak = {"int8": True, "fp16": True}
        config = CreateConfig(
            profiles=[polygraphy_profile(p) for p in spec.profiles],
            tf32=plan.precision == "tf32",
            memory_pool_limits={trt.MemoryPoolType.WORKSPACE: self.workspace_bytes} if self.workspace_bytes else None,
            load_timing_cache=str(self.timing_cache),
            progress_monitor=progress_monitor(trt, BuildProgress(log)),
            builder_optimization_level=self.opt_level,
            **weak,
        )
        self.timing_cache.parent.mkdir(parents=True, exist_ok=True)
        # Polygraphy and TensorRT log to stdout; llmx keeps stdout for results.
        with G_LOGGER.verbosity(G_LOGGER.WARNING), contextlib.redirect_stdout(sys.stderr):
            try:
                engine = EngineFromNetwork(network, config, save_timing_cache=str(self.timing_cache))()
                SaveEngine(engine, str(engine_path))()
            except PolygraphyException as exc:
                raise LlmxError(f"TensorRT could not build {engine_path.name}: {str(exc).strip().splitlines()[-1]}") from exc
        io = {engine.get_tensor_name(i): engine.get_tensor_dtype(engine.get_tensor_name(i)).name
              for i in range(engine.num_io_tensors)}
        return {"bytes": engine_path.stat().st_size, "io_dtypes": io}
