"""Does TensorRT for RTX (the ``tensorrt-rtx-cu13`` wheels) build and run on this GPU?

    python benchmarks/trt_rtx_probe.py [--onnx ART/decode.onnx] [--out probe.json]

TensorRT-RTX's support matrix lists compute capabilities 7.5, 8.6, 8.9 and 12.0; this records,
step by step, what it does on any other GPU (Hopper's 9.0 is why it was written): import,
builder, a two-layer network (MatMul with a constant, ReLU) built, deserialized and run
against numpy, then, with ``--onnx``, one of llmx's portable graphs parsed and built with
a dynamic-shape profile (what ``llmx build`` would need from it). Every step's outcome and
every message TensorRT logged at warning level or above go to the JSON; nothing stops at
the first failure except what depends on it.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from pathlib import Path

import numpy as np


def load_trt():
    try:
        import tensorrt_rtx as trt
    except ImportError:
        import tensorrt_rtx_bindings as trt  # the bindings wheel alone: no meta package
    return trt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--onnx", type=Path)
    ap.add_argument("--out", type=Path, default=Path("trt_rtx_probe.json"))
    args = ap.parse_args()
    report: dict = {"steps": []}

    def step(name, fn):
        start = time.perf_counter()
        try:
            value = fn()
            report["steps"].append(dict(step=name, ok=True, seconds=round(time.perf_counter() - start, 2),
                                        result=value if isinstance(value, (str, int, float, dict, list)) else None))
            return value
        except Exception as exc:  # the point is to record what it says
            report["steps"].append(dict(step=name, ok=False, error=f"{type(exc).__name__}: {exc}",
                                        trace=traceback.format_exc()[-1500:]))
            return None
        finally:
            print(json.dumps(report["steps"][-1])[:2000], flush=True)

    trt = step("import", load_trt)
    if trt is None:
        return finish(report, args.out)
    report["version"] = getattr(trt, "__version__", "?")
    import torch

    report["gpu"] = dict(name=torch.cuda.get_device_name(), capability=".".join(map(str, torch.cuda.get_device_capability())))

    class Log(trt.ILogger):
        def __init__(self):
            trt.ILogger.__init__(self)
            self.lines = []

        def log(self, severity, msg):
            if severity <= trt.ILogger.Severity.WARNING:
                self.lines.append(f"{severity.name}: {msg}")

    logger = Log()
    report["log"] = logger.lines
    builder = step("builder", lambda: trt.Builder(logger))
    if builder is None:
        return finish(report, args.out)

    w = np.random.default_rng(0).standard_normal((8, 8)).astype(np.float32)
    x = np.random.default_rng(1).standard_normal((4, 8)).astype(np.float32)

    def tiny_network():
        network = builder.create_network(0)
        inp = network.add_input("x", trt.float32, (4, 8))
        const = network.add_constant((8, 8), trt.Weights(w))
        mm = network.add_matrix_multiply(inp, trt.MatrixOperation.NONE, const.get_output(0), trt.MatrixOperation.NONE)
        relu = network.add_activation(mm.get_output(0), trt.ActivationType.RELU)
        relu.get_output(0).name = "y"
        network.mark_output(relu.get_output(0))
        plan = builder.build_serialized_network(network, builder.create_builder_config())
        if plan is None:
            raise RuntimeError("build_serialized_network returned None (see log)")
        return plan

    plan = step("build tiny network", tiny_network)
    if plan is not None:
        def run():
            engine = trt.Runtime(logger).deserialize_cuda_engine(plan)
            if engine is None:
                raise RuntimeError("deserialize_cuda_engine returned None (see log)")
            context = engine.create_execution_context()
            xs, ys = torch.from_numpy(x).cuda(), torch.empty((4, 8), device="cuda")
            context.set_tensor_address("x", xs.data_ptr())
            context.set_tensor_address("y", ys.data_ptr())
            stream = torch.cuda.Stream()
            if not context.execute_async_v3(stream.cuda_stream):
                raise RuntimeError("execute_async_v3 returned False (see log)")
            stream.synchronize()
            err = float(np.abs(ys.cpu().numpy() - np.maximum(x @ w, 0)).max())
            return dict(max_abs_error=err)

        step("run tiny engine", run)
    if args.onnx:
        def onnx_build():
            network = builder.create_network(0)
            parser = trt.OnnxParser(network, logger)
            if not parser.parse_from_file(str(args.onnx)):
                raise RuntimeError("; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))[:1500])
            config = builder.create_builder_config()
            profile = builder.create_optimization_profile()
            for i in range(network.num_inputs):
                t = network.get_input(i)
                dims = list(t.shape)
                lo = [1 if d == -1 else d for d in dims]
                hi = [8 if d == -1 and k == 0 else 64 if d == -1 else d for k, d in enumerate(dims)]
                profile.set_shape(t.name, lo, lo, hi)
            config.add_optimization_profile(profile)
            start = time.perf_counter()
            plan = builder.build_serialized_network(network, config)
            if plan is None:
                raise RuntimeError("build_serialized_network returned None (see log)")
            return dict(engine_bytes=plan.nbytes, build_s=round(time.perf_counter() - start, 1), inputs=network.num_inputs)

        step(f"parse and build {args.onnx.name}", onnx_build)
    finish(report, args.out)


def finish(report: dict, out: Path) -> None:
    out.write_text(json.dumps(report, indent=2))
    print("log:", *report.get("log", [])[-20:], sep="\n  ")


if __name__ == "__main__":
    main()
